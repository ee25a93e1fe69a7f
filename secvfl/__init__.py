"""secvfl: privacy-preserving vertical federated learning."""
__version__ = "0.1.0"
