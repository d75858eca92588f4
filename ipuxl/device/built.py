"""What a ``Session`` compiled: the IR's settings then, and the check that they still hold."""
from __future__ import annotations

from typing import NamedTuple

from ipuxl.errors import DeviceError, ReplicationError
from ipuxl.ir.context import user_source_line
from ipuxl.ir.ir import Ir
from ipuxl.ir.meta import SOURCE

__all__ = ["Built"]


class Built(NamedTuple):
    """The IR's replicas, steps (``num_host_transfers``) and variable count when the session
    compiled it, and where the Session was made."""

    replicas: int
    steps: int
    variables: int
    created_at: str | None

    @classmethod
    def of(cls, ir: Ir) -> "Built":
        return cls(ir.replication_factor, ir.num_host_transfers, len(ir.variable_records), user_source_line())

    def check_unchanged(self, ir: Ir, records: object) -> None:
        """Refuse to run when the IR's replicas, steps or variables changed after compiling
        (``records``: the variables the session compiled, by tensor)."""
        if (ir.replication_factor, ir.num_host_transfers, len(ir.variable_records)) == self[:3]:
            return
        where = f"Session.run at {user_source_line()}; the Session was created at {self.created_at}"
        fix = "create a new Session after changing the IR: a Session compiles the IR once, when it is created"
        if ir.replication_factor != self.replicas:
            raise ReplicationError(
                f"ir.replication_factor changed from {self.replicas} to {ir.replication_factor} after the Session "
                f"was created: the session compiled and runs {self.replicas} replica(s)", where=where, fix=fix)
        if ir.num_host_transfers != self.steps:
            raise DeviceError(
                f"ir.num_host_transfers changed from {self.steps} to {ir.num_host_transfers} after the Session "
                f"was created: the session runs {self.steps} steps per run", where=where, fix=fix)
        added = [r.tensor for r in ir.variable_records.values() if r.tensor not in records]  # type: ignore[operator]
        made = "; ".join(f"'{t.name}' made at {t.node.meta.get(SOURCE)}" for t in added)
        raise DeviceError(
            f"the IR has {len(added)} variable(s) more than when the Session was created "
            f"({', '.join(repr(t.name) for t in added)}): the compiled program does not have them",
            where=f"{where}; {made}", fix=fix)
