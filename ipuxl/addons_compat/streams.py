"""popxl.addons' ``InputStreams`` and ``OutputStreams``: named host streams, read as attributes.

As upstream's, a collection is an ordered dict of name -> stream that is also read by
position: ``streams[0]`` and ``streams[1:]`` are the streams in insertion order, and
iterating it gives the streams, not their names (``keys()`` gives the names).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Iterator

from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, d2h_stream, h2d_stream

__all__ = ["InputStreams", "OutputStreams"]


class _Streams(OrderedDict):
    """Streams by name, made in the current IR from ``name=(shape, dtype)`` keywords."""

    _make: Any = None
    _kind: type[Any] = object

    def __init__(self, **streams: tuple[tuple[int, ...], Any]):
        super().__init__()
        for name, args in streams.items():
            self[name] = type(self)._make(*args, name=name)

    @classmethod
    def from_streams(cls, streams: Iterable[Any]) -> "_Streams":
        """Existing streams, each under its own name.

        Raises:
            InvalidArgumentError: an element is not a stream of this kind.
        """
        self = cls()
        for stream in streams:
            if not isinstance(stream, cls._kind):
                raise InvalidArgumentError(f"{cls.__name__}.from_streams: expected {cls._kind.__name__}s, got "
                                           f"{type(stream).__name__}", where=user_source_line(),
                                           fix="pass the streams made with h2d_stream/d2h_stream")
            self[stream.name] = stream
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            raise AttributeError(f"No attribute '{name}'. Available Keys:\n    {self._names()}") from None

    def __getitem__(self, key: str | int | slice) -> Any:
        """The stream named ``key``, or by position: an int or a slice of the streams in order.

        Raises:
            KeyError: no stream has that name.
            IndexError: an int position past the last stream.
        """
        if isinstance(key, (int, slice)):
            return list(self.values())[key]
        try:
            return super().__getitem__(key)
        except KeyError:
            raise KeyError(f"No key '{key}'. Available Keys:\n    {self._names()}") from None

    def __iter__(self) -> Iterator[Any]:
        """The streams, in insertion order (upstream iterates values, not names)."""
        return iter(list(self.values()))

    def _names(self) -> str:
        return "\n    ".join(self.keys())


class InputStreams(_Streams):
    """Host-to-device streams by name: ``InputStreams(x=((2, 4), popxl.float32)).x``."""

    _make = staticmethod(h2d_stream)
    _kind = HostToDeviceStream


class OutputStreams(_Streams):
    """Device-to-host streams by name: ``OutputStreams(y=((2, 4), popxl.float32)).y``."""

    _make = staticmethod(d2h_stream)
    _kind = DeviceToHostStream
