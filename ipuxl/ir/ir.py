"""``Ir``: the whole program: main graph, subgraphs, variables, host streams, settings."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import numpy as np

from ipuxl.errors import InvalidArgumentError
from ipuxl.ir.graph import Graph, identifier
from ipuxl.ir.graph_builder import build_graph
from ipuxl.ir.meta import ROLE, STREAM, Role
from ipuxl.ir.replica_grouping import ReplicaGrouping
from ipuxl.ir.streams import DeviceToHostStream, HostToDeviceStream, Stream
from ipuxl.ir.tensor import Variable
from ipuxl.ir.world import total_replicas, world

if TYPE_CHECKING:
    from ipuxl.ir.popart_options import PopartIr, SessionOptions

__all__ = ["Ir", "VariableRecord"]


@dataclass
class VariableRecord:
    """A variable of the main graph and the host data it is initialised with.

    With a replica grouping of G > 1 groups, ``data`` holds one value per group,
    shaped ``(G, *tensor.shape)``; ``retrieval_mode`` is PopXL's: "one_per_group"
    (host data per group) or "all_replicas" (host data per replica).
    """

    tensor: Variable
    data: np.ndarray
    grouping: ReplicaGrouping | None = None
    retrieval_mode: str = "one_per_group"
    shard_over: int | None = None
    """Replicated tensor sharding (``ipuxl.ir.remote``): each replica holds its 1-D shard of
    ``shard_over`` of the full value ``data`` (per group); None: not sharded."""

    def replica_grouping(self, replication_factor: int) -> ReplicaGrouping:
        """The variable's grouping, or one group of all ``replication_factor`` replicas."""
        return self.grouping or ReplicaGrouping(replication_factor)


class Ir:
    """A PopXL IR: build ops in ``ir.main_graph``, subgraphs with ``create_graph``.

    Args:
        replication: number of data-parallel replicas (``replication_factor``), or
            ``"popdist"``: popdist's total replica count (``ipuxl.ir.world.total_replicas``:
            one replica per process of torchrun's world unless PopRun's
            ``POPDIST_NUM_*_REPLICAS`` variables say otherwise; 1 when not launched), as
            PopXL takes it from popdist.

    Example:
        >>> import ipuxl, ipuxl.ops as ops
        >>> ir = ipuxl.Ir()
        >>> with ir.main_graph:
        ...     x = ipuxl.variable([1.0, 2.0], name="x")
        ...     y = ops.mul(x, 2.0)
    """

    _ids = itertools.count()

    def __init__(self, replication: int | Literal["popdist"] = 1):
        self.id = next(Ir._ids)
        self.replication_factor = total_replicas() if replication == "popdist" else replication
        self.num_host_transfers = 1
        self.graphs: list[Graph] = []
        self._subgraph_count = 0
        self._op_ids = itertools.count(100)  # PopART numbers ops across the IR from 100
        self.streams: list[Stream] = []
        self.variable_records: dict[str, VariableRecord] = {}
        self.main_graph = Graph(self, "main_graph")
        self.graphs.append(self.main_graph)

    # -- settings -------------------------------------------------------------------
    @property
    def _pb_ir(self) -> "PopartIr":
        """Stand-in for PopXL's PopART IR: ``getSessionOptions()`` (``ipuxl.ir.popart_options``)."""
        from ipuxl.ir.popart_options import PopartIr

        return self.__dict__.setdefault("_popart_ir", PopartIr())

    @property
    def session_options(self) -> "SessionOptions":
        """PopART's session options of this IR: ``ir._pb_ir.getSessionOptions()``."""
        return self._pb_ir.getSessionOptions()

    @property
    def replication_factor(self) -> int:
        return self._replication_factor

    @replication_factor.setter
    def replication_factor(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(
                f"replication factor must be a positive int, got {value!r}",
                fix="use Ir(replication=1) for one replica, or Ir(replication='popdist') for one per process",
            )
        self._replication_factor = value

    @property
    def num_host_transfers(self) -> int:
        return self._num_host_transfers

    @num_host_transfers.setter
    def num_host_transfers(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(
                f"num_host_transfers must be a positive int, got {value!r}",
                fix="set ir.num_host_transfers to the number of times each stream is loaded (or stored) per Session.run",
            )
        self._num_host_transfers = value

    def replica_grouping(self, stride: int = 1, group_size: int | None = None) -> ReplicaGrouping:
        """Groups of this IR's replicas: members ``stride`` apart, ``group_size`` per group
        (default: ``replication_factor // stride``). See ``ReplicaGrouping``."""
        return ReplicaGrouping(self.replication_factor, stride, group_size)

    def replica_grouping_from_assignments(self, assignment: Sequence[int]) -> ReplicaGrouping:
        """The grouping putting replica ``r`` in group ``assignment[r]`` (PopXL's).

        Groups are numbered 0, 1, ... in order of first appearance and are all the same
        size. A grouping with one stride between all members is returned as
        ``replica_grouping(stride, group_size)``; others are non-const (``is_const``).

        Raises:
            ReplicationError: (a ValueError) the assignment does not fit those rules or
                has a length other than ``replication_factor``.
        """
        return ReplicaGrouping.from_assignment(self.replication_factor, assignment)

    @property
    def num_ipus(self) -> int:
        """IPUs one replica of the program uses: 1 + the largest IPU id of its ops and
        variables (``ipuxl.ipu(n)``, PopART's virtual graphs)."""
        from ipuxl.ir.placement import num_ipus  # placement reads graphs: bind late

        return num_ipus(self)

    @property
    def instance_replication_factor(self) -> int:
        """Replicas run by this process (all of them unless launched with torchrun)."""
        size, _ = world()
        return self.replication_factor // size if self.replication_factor % size == 0 else self.replication_factor

    # -- graphs -------------------------------------------------------------------------
    def create_graph(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Graph:
        """Build a subgraph by calling ``fn`` (a function or ``ipuxl.Module``).

        Tensor and TensorSpec arguments become graph inputs in signature order; other
        arguments are passed through as Python values. Inside ``fn``,
        ``ipuxl.graph_input`` adds further inputs. ``fn``'s return value(s) become
        the graph's outputs.
        """
        return build_graph(self, fn, args, kwargs)

    def next_op_id(self) -> int:
        """A fresh op id (ops are numbered across the IR)."""
        return next(self._op_ids)

    def create_empty_graph(self, name: str | None = None) -> Graph:
        """A new subgraph without inputs or ops (PopXL's ``create_empty_graph``)."""
        return self.new_subgraph(name or "graph")

    def new_subgraph(self, name: str) -> Graph:
        """A new subgraph, named as PopXL does: ``{name}_subgraph({k})``, k counting per IR."""
        graph = Graph(self, f"{name}_subgraph({self._subgraph_count})", base_name=identifier(name))
        self._subgraph_count += 1
        self.graphs.append(graph)
        return graph

    # -- streams and variables --------------------------------------------------------
    def get_all_h2d_streams(self) -> list[HostToDeviceStream]:
        """The host-to-device streams some ``ops.host_load`` of the IR loads (PopXL's: a stream
        nothing loads is not an input of the program)."""
        used = self._used_streams()
        return [s for s in self.streams if isinstance(s, HostToDeviceStream) and s in used]

    def get_all_d2h_streams(self) -> list[DeviceToHostStream]:
        """The device-to-host streams some ``ops.host_store`` of the IR stores to (PopXL's)."""
        used = self._used_streams()
        return [s for s in self.streams if isinstance(s, DeviceToHostStream) and s in used]

    def _used_streams(self) -> set[Stream]:
        return {n.meta[STREAM] for g in self.graphs for n in g.fx.nodes
                if n.meta.get(ROLE) in Role.STREAMS and STREAM in n.meta}

    @property
    def variables(self) -> list[Variable]:
        return [record.tensor for record in self.variable_records.values()]

    def record_variable(self, attr: str, tensor: Variable, data: np.ndarray, grouping: ReplicaGrouping | None,
                        retrieval_mode: str) -> VariableRecord:
        """Register variable ``tensor`` of the main graph (``get_attr`` target ``attr``) and its
        initial host data (see ``VariableRecord``)."""
        record = VariableRecord(tensor, data, grouping, retrieval_mode)
        self.variable_records[attr] = record
        return record

    def unique_stream_name(self, name: str) -> str:
        """``name``, suffixed if a stream of this IR already has it."""
        return self.unique_name({s.name for s in self.streams}, name, add=False)

    @staticmethod
    def unique_name(taken: set[str], name: str, add: bool = True) -> str:
        """``name``, or ``name_k`` with the smallest k making it not in ``taken`` (added to it if ``add``)."""
        candidate, i = name, 1
        while candidate in taken:
            candidate = f"{name}_{i}"
            i += 1
        if add:
            taken.add(candidate)
        return candidate

    def __repr__(self) -> str:
        return (f"Ir[{len(self.graphs)} graphs, {len(self.variable_records)} variables, "
                f"replication={self.replication_factor}, num_host_transfers={self.num_host_transfers}]")
