"""A rank's stream of batches as a DataLoader-like iterable that can checkpoint and resume.

:class:`Stream` is torch-free: ``for batch in stream`` runs one epoch, it has ``len`` (batches
per epoch for this rank), ``set_epoch`` and the ``state_dict``/``load_state_dict`` pair of
torchdata's ``StatefulDataLoader``. :class:`stoker.torch.Loader` is the same class yielding
torch tensors.

The state is where the trainer stands in the epoch's shuffled order: ``position`` = samples
of epoch ``epoch``'s order consumed by all ranks together. Ranks of synchronous data-parallel
training consume the same number of batches, so every rank's state has the same (epoch,
position): saving rank 0's is enough, and loading it on every rank resumes the job, also with
another world size (the sidecar re-shards what is left of the epoch).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, Optional, Tuple

from .client import Batch, Client, StokerError

#: Version of the state_dict layout; load_state_dict refuses others.
STATE_VERSION = 1
_ORDER_FIELDS = ("seed", "batch_size", "samples")


class StateMismatch(StokerError, ValueError):
    """A state_dict that cannot be loaded here (another dataset, seed or batch size)."""


class Stream:
    """This rank's batches, one epoch per iteration, with checkpoint/resume.

    Connects on first use (``socket_path`` as :class:`Client`: ``STOKER_SOCKET``, else
    ``$STOKER_SHM_DIR/stoker-$LOCAL_RANK.sock``; rank and world size from torchrun's env).
    The previous batch is released when the next one is requested. ``collate`` maps each
    yielded item (here a :class:`Batch`) to what the loop receives.

    ``lookahead``: batches the training loop takes from the iterator before it trains the
    current one, so that ``state_dict`` leaves them out: 0 for a plain loop and HF ``Trainer``
    (it checkpoints after training every batch it fetched), 1 for Lightning (its fetcher keeps
    one batch ahead).
    """

    def __init__(
        self,
        socket_path: Optional[str] = None,
        *,
        client: Optional[Client] = None,
        collate: Optional[Callable[[Any], Any]] = None,
        connect_timeout: float = 30.0,
        next_timeout: float = 120.0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        lookahead: int = 0,
    ):
        if lookahead < 0:
            raise StokerError("lookahead must be >= 0, not %d" % lookahead)
        self._client = client
        self._client_args = dict(
            socket_path=socket_path, connect_timeout=connect_timeout, next_timeout=next_timeout, rank=rank, world_size=world_size
        )
        self.collate = collate
        self._held: Optional[Batch] = None
        # (epoch, position) after each of the last lookahead + 1 batches yielded, oldest first:
        # [-1] is where the stream stands, [0] what a checkpoint taken now resumes from.
        self._states: Deque[Tuple[int, int]] = deque(maxlen=lookahead + 1)
        self._done = False

    # -- connection -------------------------------------------------------------------------

    @property
    def client(self) -> Client:
        """The connection, opened on first use."""
        return self._connected()

    def _connected(self) -> Client:
        if self._client is None:
            self._client = Client(**self._client_args)
        if not self._states:
            self._restart_at(*self._stream_start(self._client.info))
        return self._client

    @staticmethod
    def _stream_start(info: Dict[str, Any]):
        if "epoch" not in info or "position" not in info:
            raise StokerError(
                "the sidecar's hello has no epoch/position: it is older than this client and cannot "
                "checkpoint or resume"
            )
        return int(info["epoch"]), int(info["position"])

    @property
    def info(self) -> Dict[str, Any]:
        """The sidecar's ``hello`` (rank, world_size, batch_size, samples, seed, resize, ...)."""
        return self.client.info

    # -- iteration --------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch for this rank at the current world size."""
        return int(self.info["batches_per_epoch"])

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch; ends at its end (or when the sidecar is done)."""
        client = self.client
        # This iterator's own batch: an abandoned iterator that is closed later (garbage
        # collected) must not release the batch a newer one is using.
        held: Optional[Batch] = None
        try:
            while not self._done:
                if held is not None:
                    held.release()
                item = client.next()
                if item is None:
                    self._done = True
                    return
                if isinstance(item, tuple):
                    # Every batch of the epoch has been handed over: nothing is ahead any more.
                    self._restart_at(item[1] + 1, 0)
                    return
                held = self._held = item
                if item.position is None:
                    raise StokerError("the sidecar's batches carry no position: it is older than this client")
                out = self._deliver(item)
                self._states.append((item.epoch, item.position))
                yield out
        finally:
            if held is not None:
                held.release()

    def _deliver(self, batch: Batch) -> Any:
        item = self._convert(batch)
        return item if self.collate is None else self.collate(item)

    def _convert(self, batch: Batch) -> Any:
        """What a batch becomes before ``collate``; :class:`stoker.torch.Loader` makes tensors."""
        return batch

    def _release_held(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            held.release()

    # -- state ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._state()[0]

    @property
    def position(self) -> int:
        """Samples of this epoch's order consumed by all ranks up to the last batch yielded."""
        return self._state()[1]

    def _state(self) -> Tuple[int, int]:
        self._connected()
        return self._states[-1]

    def _restart_at(self, epoch: int, position: int) -> None:
        self._states.clear()
        self._states.append((epoch, position))

    def state_dict(self) -> Dict[str, Any]:
        """Where the batches handed over so far (less ``lookahead``) leave this rank: save it
        with the model."""
        info = self.info
        epoch, position = self._states[0]
        return {
            "stoker": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": int(info["seed"]),
            "batch_size": int(info["batch_size"]),
            "samples": int(info["samples"]),
            "world_size": int(info["world_size"]),
            "rank": int(info["rank"]),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes from a state_dict (any rank's, any world size): the next batch is the first
        one this rank had not been given when it was saved."""
        epoch, position = validate_state(state, self.info)
        self._seek(epoch, position)

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` from its beginning, unless the stream already stands in it (e.g.
        just after loading a mid-epoch state_dict, which this keeps)."""
        if epoch < 0:
            raise StokerError("epoch must be >= 0, not %d" % epoch)
        if epoch != self.epoch:
            self._seek(epoch, 0)

    def _seek(self, epoch: int, position: int) -> None:
        self._release_held()
        info = self.info
        self.client.seek(epoch, position, int(info["seed"]), int(info["batch_size"]), int(info["samples"]))
        self._restart_at(epoch, position)
        self._done = False

    def close(self) -> None:
        self._release_held()
        if self._client is not None:
            self._client.close()
            self._client = None
            self._states.clear()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def validate_state(state: Dict[str, Any], info: Dict[str, Any]):
    """(epoch, position) of ``state`` after checking it fits the sidecar's dataset and order."""
    if not isinstance(state, dict) or state.get("stoker") != STATE_VERSION:
        raise StateMismatch(
            "not a stoker state_dict of version %d (got %r)"
            % (STATE_VERSION, state.get("stoker") if isinstance(state, dict) else type(state).__name__)
        )
    missing = [k for k in ("epoch", "position") + _ORDER_FIELDS if k not in state]
    if missing:
        raise StateMismatch("the stoker state_dict lacks %s" % ", ".join(missing))
    for field in _ORDER_FIELDS:
        if int(state[field]) != int(info[field]):
            raise StateMismatch(
                "the checkpoint's %s is %s but the sidecar's is %s: resuming would replay another "
                "order (same dataset, --seed and --batch-size needed)" % (field, state[field], info[field])
            )
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= position <= int(info["samples"]):
        raise StateMismatch(
            "the checkpoint's epoch %d position %d is outside the dataset of %s samples" % (epoch, position, info["samples"])
        )
    return epoch, position
