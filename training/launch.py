"""Where this process sits in its run: rank 0 of 1, or its place among the processes torchrun started, read from
torchrun's environment variables. Plain Python, so that train.py reads it before it imports torch."""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60


def cut_short(value: object) -> str:
    """repr(value), cut short past 60 characters: a variable or setting quoted in a message may be any length."""
    return _REPR.repr(value)


# The most processes torch.distributed's rendezvous takes (its store counts them in a C int): a WORLD_SIZE of 2**31
# was a TypeError traceback from the store's constructor.
MAX_WORLD_SIZE = 2**31 - 1


class LaunchError(ValueError):
    """torchrun's environment is unusable, or the processes could not join; the message is one line for a person."""


@dataclass(frozen=True, kw_only=True)
class Launch:
    """This process's place in its run: rank ``rank`` of ``world_size`` processes, ``local_rank`` of
    ``local_world_size`` on this machine. ``torchrun``: started by torchrun, so a process group joins the processes
    (even a group of one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    torchrun: bool = False

    @property
    def main(self) -> bool:
        """Rank 0: the one process that prints, writes TensorBoard logs and saves checkpoints."""
        return self.rank == 0


def launch_from_env(environ: Mapping[str, str] | None = None) -> Launch:
    """The Launch that torchrun's variables describe; rank 0 of 1 when they are absent."""
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return Launch()
    if "RANK" not in env or "WORLD_SIZE" not in env:
        # One without the other is no launcher's doing (torchrun sets both): a second process started by hand as rank
        # 1 trained as a rank 0 of its own. Alone, the values that mean one process are let through.
        name, other, one = ("RANK", "WORLD_SIZE", 0) if "RANK" in env else ("WORLD_SIZE", "RANK", 1)
        value = env[name].strip()
        if value and not (value.isdigit() and int(value) == one):  # empty, or 0 / 00, ran as one process before
            raise LaunchError(f"{name}={cut_short(env[name])} is set but {other} is not; start the run with torchrun, "
                              f"which sets both, or unset {name} to run one process")
        return Launch()
    raw = {"RANK": env["RANK"], "WORLD_SIZE": env["WORLD_SIZE"], "LOCAL_RANK": env.get("LOCAL_RANK", "0"),
           # without LOCAL_WORLD_SIZE (a launcher other than torchrun), assume one machine
           "LOCAL_WORLD_SIZE": env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])}
    try:
        rank, world, local_rank, local_world = (int(raw[name]) for name in raw)
    except ValueError:
        values = ", ".join(f"{k}={cut_short(v)}" for k, v in raw.items())  # each cut short: any length is set
        raise LaunchError(f"torchrun's environment variables are not whole numbers ({values}); start the run with "
                          f"torchrun, or unset RANK and WORLD_SIZE to run one process") from None
    if world > MAX_WORLD_SIZE:
        raise LaunchError(f"torchrun's WORLD_SIZE={world} is more processes than torch.distributed takes (at most "
                          f"{MAX_WORLD_SIZE:,}); start the run with torchrun, or unset RANK and WORLD_SIZE to run one "
                          f"process")
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        rank, world, local_rank, local_world = (cut_short(n) for n in (rank, world, local_rank, local_world))
        raise LaunchError(f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK="
                          f"{local_rank}, LOCAL_WORLD_SIZE={local_world}; start the run with torchrun, or unset RANK "
                          f"and WORLD_SIZE to run one process")
    return Launch(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world, torchrun=True)
