from secvfl.transport.base import CommStats, Transport
from secvfl.transport.inprocess import InProcessTransport
from secvfl.transport.network import Network, Role

__all__ = ["Transport", "CommStats", "InProcessTransport", "Network", "Role"]
