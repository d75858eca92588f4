"""The keys ipuxl stores in ``fx.Node.meta``: the one place they are spelled.

An IR graph is a ``torch.fx.Graph``; what PopXL knows about a tensor or an op that
fx does not (its user-facing name, its role as a graph input, what an in-place op
writes) lives in the node's ``meta`` dict under these keys. Read and write them
through these names, never as string literals.

Node kinds and the keys they carry:

* every node: ``"val"`` (torch's own key: a meta tensor, or a tuple of them, giving
  shape and dtype).
* placeholders (graph inputs): ``NAME``, ``ROLE`` (one of ``Role``), ``BY_REF``; host
  stream slots also ``STREAM``.
* ops: ``OP`` (the PopXL op name), ``OP_ID``, ``SOURCE`` (the user's source line),
  ``NAME`` when the user named the result, ``IN_SEQUENCE`` under
  ``ipuxl.in_sequence()``, and the alias records below.
* calls of subgraphs: ``CALLED_GRAPH``, ``BY_REF_ARGS``; ``OUTLINED`` when the
  outlining pass made the call; ``IO_GATE`` on the branch calls of a conditional.

Alias records (see ``ipuxl.ir.aliases`` for their meaning):

* ``MODIFIES``: an in-place op's result: the node it wrote to and returns.
* ``VIEW_OF``: an op whose result shares storage with an input (reshape, slicing...).
* ``WRITES``: every node an op writes in place (its in-place roots).

These are the keys whose values are nodes: copy nodes between graphs with
``ipuxl.ir.copy.copy_node``, which remaps them (``fx.Graph.node_copy`` alone would
leave them naming the old graph's nodes).
"""
from __future__ import annotations

__all__ = [
    "NAME", "ROLE", "BY_REF", "STREAM", "OP", "OP_ID", "SOURCE", "IN_SEQUENCE", "MODIFIES", "VIEW_OF", "WRITES",
    "CALLED_GRAPH", "BY_REF_ARGS", "OUTLINED", "IO_GATE", "NO_GRAD", "META_SHAPE", "IPU", "TILE_SET", "PIPELINE_STAGE", "REMOTE",
    "Role", "COLLECTIVE_OPS",
]

NAME = "ipuxl_name"
"""The user's name for the tensor (``str``)."""
ROLE = "ipuxl_role"
"""What a placeholder or ``get_attr`` node is: one of the ``Role`` values."""
BY_REF = "ipuxl_by_ref"
"""On a subgraph input: ``True`` when callers pass it by reference (``TensorByRef``)."""
STREAM = "ipuxl_stream"
"""On a host-stream slot (``Role.H2D``/``Role.D2H`` placeholders): the stream object."""
OP = "ipuxl_op"
"""The PopXL op name of an op node (``"matmul"``, ``"call"``, ``"output_of"``...)."""
OP_ID = "ipuxl_op_id"
"""The op's id, numbered across the IR from 100 as PopART does (``int``)."""
SOURCE = "ipuxl_source"
"""The user's source line that built the op (``"file.py:12"``), or ``None``."""
IN_SEQUENCE = "ipuxl_in_sequence"
"""``True`` on ops built under ``ipuxl.in_sequence()``: they keep their relative order."""
MODIFIES = "ipuxl_modifies"
"""On an in-place op: the node it writes to, whose storage its result is."""
VIEW_OF = "ipuxl_view_of"
"""On a view op: the input node whose storage its result shares."""
WRITES = "ipuxl_writes"
"""On any op that writes in place: the list of nodes it writes (in-place roots)."""
CALLED_GRAPH = "ipuxl_called_graph"
"""On a call or repeat node: the IR ``Graph`` it runs."""
BY_REF_ARGS = "ipuxl_by_ref_args"
"""On a call node: the set of argument positions passed by reference."""
OUTLINED = "ipuxl_outlined"
"""On a call node the outlining pass created: ``True``."""
IO_GATE = "ipuxl_io_gate"
"""On a call of a branch of ``ops.conditional`` (in its select graph): ``(k, taken_when)``,
meaning the callee's host transfers happen only when input ``k`` of the calling graph (the
condition) is ``taken_when``; otherwise its loads read zeros and its stores go nowhere."""
NO_GRAD = "ipuxl_no_grad"
"""On a subgraph input: ``True`` when no call of the graph passes a value that needs a
gradient (a captured block's attention mask, a frozen parameter): autodiff's default
``grads_required`` (all floating-point inputs) leaves it out, as eager autograd would."""
META_SHAPE = "ipuxl_meta_shape"
"""On collective ops: the shape of the tensor before replication-dependent reshaping."""
IPU = "ipuxl_ipu"
"""On ops and variables: the IPU (PopART's virtual graph id, ``int``) they are placed on
(``popxl.ipu(n)``, PopTorch's ``Block``/``BeginBlock``); absent means IPU 0; ``None``: built
under ``popxl.ipu(None)``, no IPU recorded (PopXL's "undefined")."""
TILE_SET = "ipuxl_tile_set"
"""On ops: ``"compute"`` or ``"io"`` (built under ``popxl.io_tiles()``), the tile set PopXL
reports as ``Tensor.tile_set``; absent on inputs, variables and constants (undefined)."""
PIPELINE_STAGE = "ipuxl_pipeline_stage"
"""On ops: the pipeline stage (``int``) they belong to (PopTorch ``Stage``, popxl.addons
``pipeline.stage(i)``); absent means no pipelining."""
REMOTE = "ipuxl_remote"
"""On variables and remote ops: the remote buffer (Streaming Memory) they live in or access."""


class Role:
    """Values of ``ROLE``: why a placeholder or attribute node is in the graph."""

    INPUT = "input"
    """A graph input (``graph_input`` / a ``create_graph`` argument)."""
    H2D = "h2d"
    """The slot a host-to-device stream's data arrives in (``ops.host_load``)."""
    D2H = "d2h"
    """The slot a device-to-host stream's data leaves from (``ops.host_store``)."""
    VARIABLE = "variable"
    """A variable of the IR (``get_attr``)."""
    CONSTANT = "constant"
    """A constant (``get_attr``)."""
    SEED = "seed"
    """A captured module's random-seed input (``capture``: dropout seeds derive from it)."""

    STREAMS = (H2D, D2H)


#: ``OP`` values of the collectives (``ops.collectives``): ops whose result depends on
#: every replica, which passes keep in order and autodiff refuses.
COLLECTIVE_OPS = ("replicated_all_reduce", "replicated_all_reduce_", "replicated_reduce_scatter",
                  "replicated_all_gather", "replicated_all_reduce_TP")
