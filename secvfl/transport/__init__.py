from secvfl.transport.base import CommStats, Transport
from secvfl.transport.inprocess import InProcessTransport
from secvfl.transport.layers import Role
from secvfl.transport.network import Network

__all__ = ["Transport", "CommStats", "InProcessTransport", "Network", "Role"]
