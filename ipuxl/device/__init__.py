"""The simulated IPU device: ``Session`` compiles an IR once and runs it."""
from ipuxl.device.session import DeviceType, Session, device_for

__all__ = ["DeviceType", "Session", "device_for"]
