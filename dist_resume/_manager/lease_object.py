"""What a write lease object says: who holds it, since when, until when, and the holder's token; as JSON, parsed
totally (a damaged object is None: taken over at once), and in words. Torch-free."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Final

from .holder import Holder

__all__ = ["LEASE_SECONDS", "Lease"]

LEASE_SECONDS: Final = 60.0  # a lease not renewed within this is expired: any writer may take it over


def _optional(fields: dict[str, Any], name: str, kind: type[Any]) -> Any:
    value = fields.get(name)
    return None if value is None else kind(value)


@dataclass(frozen=True)
class Lease:
    """What the lease object says: who holds it, since when, until when, and the holder's token."""

    host: str
    pid: int
    since: float
    expires: float
    token: str
    node: str | None = None
    start: int | None = None
    job: str | None = None
    generation: int | None = None

    @property
    def holder(self) -> Holder:
        return Holder(self.host, self.pid, self.node, self.start, self.job, self.generation)

    def to_json(self) -> bytes:
        return json.dumps(vars(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Lease | None:
        """The lease, or None for an object that is not one (damaged, or written by hand): taken over at once."""
        try:
            fields: dict[str, Any] = json.loads(data)
            return cls(str(fields["host"]), int(fields["pid"]), float(fields["since"]), float(fields["expires"]),
                       str(fields["token"]), _optional(fields, "node", str), _optional(fields, "start", int),
                       _optional(fields, "job", str), _optional(fields, "generation", int))  # fmt: skip
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
            return None

    def describe(self, now: float) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        renewed = now - (self.expires - LEASE_SECONDS)
        return (
            f"{self.holder.describe()}, since {since} (held {now - self.since:.0f} s, renewed {renewed:.0f} s ago; "
            f"its lease expires in {self.expires - now:.0f} s unless renewed)"
        )
