"""The broadcast weight transport: tensors go from trainer rank 0 to every inference worker through a
torch.distributed group formed for the step; `weights/step_N/` holds only a manifest.

The step directory keeps the marker protocol of the filesystem transport (staged, renamed, `COMPLETE`
last), so the policy version, retention, resume and the monitor work unchanged; it holds `config.json`
and `broadcast.json`: where the sender waits (host and port of a TCPStore, a nonce naming this serving
of the step, backend, timeout). The tensors' names, shapes and dtypes travel in each bucket's header,
because buckets are gathered while they are sent.

One step, one group. The sender hosts a fresh TCPStore and publishes the manifest; the orchestrator's
watcher sees the marker, pauses the servers and asks each worker to join (`Receiver`); workers take
ranks 1..N, the sender is rank 0; bucket by bucket the sender broadcasts one flat byte buffer that the
workers view as tensors. Forming a group per step costs ≈ 0.1 s on CPU (bench/bench_weight_broadcast.py)
and needs no liveness handling: a restarted server or trainer simply joins the next step's group. The
group is built directly on a prefix of that store (`ProcessGroupGloo` / `ProcessGroupNCCL`), never as
the default group: both sides already have one of their own.

Store keys, under `rlctl/<nonce>/`: `joined` (counter, a worker's rank), `world` (1 + workers, set by
every worker), `go` ("1" once the sender forms the group, "abort" when it gave up), `finished` (counter).
"""
from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable

from rlctl.orchestrator.exchange.steps import MARKER, publish_step, step_dir_name
from rlctl.orchestrator.exchange.weights import RankGroup, SingleProcess, StepDirectoryStore

MANIFEST_FILE = "broadcast.json"
CONFIG_FILE = "config.json"
ALIGN = 64  # every tensor starts at a multiple of this in a bucket, so its bytes can be viewed as its dtype
POLL_S = 0.01  # how often the sender looks for joined workers


class BroadcastError(RuntimeError):
    """The other side did not come, gave up, or sent something else; the message says which."""


# ---- buckets on the wire ------------------------------------------------------------------------
# Each bucket travels as two broadcasts: its sizes (int64 [header bytes, payload bytes]; [0, 0] ends the
# stream), then one uint8 buffer: a JSON header naming its tensors (name, shape, dtype) and their bytes.
# The header rides with the data because buckets are produced lazily (gathered as they are sent), so
# the layout is not known when the manifest is published.


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def encode_bucket(bucket: dict, device="cpu"):
    """(sizes, buffer) of one bucket {name: tensor}: header then every tensor at an aligned offset."""
    import torch

    specs = [{"name": k, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
             for k, t in bucket.items()]
    header = json.dumps(specs).encode()
    at = aligned(len(header))
    payload = at + sum(aligned(t.numel() * t.element_size()) for t in bucket.values())
    buffer = torch.empty(payload, dtype=torch.uint8, device=device)
    buffer[:len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for t in bucket.values():
        n = t.numel() * t.element_size()
        buffer[at:at + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        at += aligned(n)
    return torch.tensor([len(header), payload], dtype=torch.int64, device=device), buffer


def decode_bucket(buffer, header_bytes: int) -> list[tuple[str, object]]:
    """(name, tensor) views into a received bucket buffer, no copy."""
    import torch

    specs = json.loads(bytes(buffer[:header_bytes].cpu().tolist()))
    out, at = [], aligned(header_bytes)
    for spec in specs:
        dtype = getattr(torch, spec["dtype"])
        count = 1
        for dim in spec["shape"]:
            count *= dim
        n = count * torch.empty((), dtype=dtype).element_size()
        out.append((spec["name"], buffer[at:at + n].view(dtype).view(spec["shape"])))
        at += aligned(n)
    return out


# ---- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    step: int
    host: str
    port: int
    nonce: str
    backend: str  # "gloo" or "nccl"
    timeout_s: float
    serving: bool = True  # False: nobody will send (step 0: servers start from the model directory)

    def to_json(self) -> dict:
        return {"step": self.step, "host": self.host, "port": self.port, "nonce": self.nonce,
                "backend": self.backend, "timeout_s": self.timeout_s, "serving": self.serving}

    @classmethod
    def from_json(cls, data: dict) -> "Manifest":
        return cls(step=int(data["step"]), host=data["host"], port=int(data["port"]), nonce=data["nonce"],
                   backend=data["backend"], timeout_s=float(data["timeout_s"]), serving=bool(data["serving"]))


def read_manifest(step_dir: Path) -> Manifest:
    step_dir = Path(step_dir)
    if not (step_dir / MARKER).exists():
        raise FileNotFoundError(f"{step_dir} has no {MARKER} marker: refusing a partial step")
    return Manifest.from_json(json.loads((step_dir / MANIFEST_FILE).read_text()))


def is_broadcast_step(step_dir: Path) -> bool:
    return (Path(step_dir) / MANIFEST_FILE).is_file()


# ---- the group -----------------------------------------------------------------------------------


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port (what gloo must bind to so the peer reaches it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))  # UDP: no packet is sent, the kernel only picks the route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def form_group(store, rank: int, world: int, backend: str, timeout_s: float, bind: str):
    """A process group of its own on `store` (a prefix store); the default group is left alone."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    return dist.ProcessGroupGloo(store, rank, world, options)


def broadcast(group, tensor) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class Sender:
    """Rank 0 of one step's group: host the store, wait for the workers, send buckets, see them finish."""

    def __init__(self, host: str, timeout_s: float, backend: str = "gloo", device="cpu"):
        import secrets

        import torch.distributed as dist

        self.host, self.timeout_s, self.backend, self.device = host, timeout_s, backend, device
        self.base = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout_s))
        self.port = self.base.port
        self.nonce = secrets.token_hex(8)
        self.base.set("nonce", self.nonce)
        self.store = dist.PrefixStore(f"rlctl/{self.nonce}", self.base)
        self.group = None
        self.workers = 0
        self.sent_bytes = 0
        self._pending: list = []  # (work, tensors it reads): a bucket is sent while the next is gathered

    def manifest(self, step: int, serving: bool = True) -> Manifest:
        return Manifest(step, self.host, self.port, self.nonce, self.backend, self.timeout_s, serving)

    def wait_workers(self, stop: Callable[[], str | None]) -> int:
        """Block until every worker joined (returns how many); BroadcastError after the timeout or when
        `stop()` names a reason to give up (the run is done, a preemption)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.store.check(["world"]):
                self.workers = int(self.store.get("world")) - 1
                if self.store.add("joined", 0) >= self.workers:
                    return self.workers
            reason = stop()
            if reason or time.monotonic() > deadline:
                self.store.set("go", "abort")
                raise BroadcastError(reason or f"no inference worker joined the weight broadcast within "
                                     f"{self.timeout_s:g} s (weights.broadcast_timeout_s): is the orchestrator alive?")
            time.sleep(POLL_S)

    def start(self) -> None:
        self.store.set("go", "1")
        self.group = form_group(self.store, 0, self.workers + 1, self.backend, self.timeout_s,
                                route_address(self.host, self.port))

    def send(self, bucket: dict) -> None:
        """Start sending one bucket {name: tensor}; returns once the one before it is out."""
        sizes, buffer = encode_bucket(bucket, self.device)
        self._post(sizes, buffer)
        self.sent_bytes += buffer.numel()

    def _post(self, *tensors) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        for t in tensors:
            self._pending.append((self.group.broadcast([t], options), t))
        while len(self._pending) > 2:  # the previous bucket's sizes + buffer may stay in flight
            self._pending.pop(0)[0].wait()

    def finish(self) -> None:
        """End the stream, wait (bounded) until every worker has its last bucket, drop group and store."""
        import torch

        self._post(torch.zeros(2, dtype=torch.int64, device=self.device))
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        deadline = time.monotonic() + self.timeout_s
        while self.store.add("finished", 0) < self.workers and time.monotonic() < deadline:
            time.sleep(0.002)
        self.close()

    def close(self) -> None:
        self.group = None
        self.store = self.base = None


class Receiver:
    """One inference worker's side: join the group the manifest names, receive each bucket's tensors."""

    def __init__(self, manifest: Manifest, workers: int, device="cpu"):
        import torch.distributed as dist

        self.manifest, self.device = manifest, device
        timeout = timedelta(seconds=manifest.timeout_s)
        try:
            base = dist.TCPStore(manifest.host, manifest.port, is_master=False, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - name the rendezvous whatever torch raised
            raise BroadcastError(f"weights step {manifest.step}: cannot reach the sender at "
                                 f"{manifest.host}:{manifest.port}: {exc}") from exc
        if base.get("nonce").decode() != manifest.nonce:
            raise BroadcastError(f"weights step {manifest.step}: {manifest.host}:{manifest.port} serves another step")
        self._base = base
        self.store = dist.PrefixStore(f"rlctl/{manifest.nonce}", base)
        self.rank = self.store.add("joined", 1)
        self.store.set("world", str(workers + 1))
        self.store.wait(["go"], timeout)
        if self.store.get("go").decode() != "1":
            raise BroadcastError(f"weights step {manifest.step}: the sender gave up")
        self.group = form_group(self.store, self.rank, workers + 1, manifest.backend, manifest.timeout_s,
                                route_address(manifest.host, manifest.port))
        self.received_bytes = 0

    def buckets(self):
        """Yield each bucket's (name, tensor) views as it arrives (a fresh buffer per bucket)."""
        import torch

        while True:
            sizes = torch.empty(2, dtype=torch.int64, device=self.device)
            broadcast(self.group, sizes)
            header, payload = (int(x) for x in sizes.tolist())
            if payload == 0:
                break
            buffer = torch.empty(payload, dtype=torch.uint8, device=self.device)
            broadcast(self.group, buffer)
            self.received_bytes += payload
            yield decode_bucket(buffer, header)
        self.store.add("finished", 1)
        self.group = None


def stored_nonce(manifest: Manifest, timeout_s: float = 2.0) -> str | None:
    """The nonce the manifest's store answers with, or None when nothing answers (the trainer that
    served this step is gone): the watcher skips such a step until it is published again."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(manifest.host, manifest.port, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        return store.get("nonce").decode()
    except Exception:  # noqa: BLE001 - refused, timed out, reset: not served
        return None


def is_served(step_dir: Path) -> bool:
    """Whether a sender is waiting for workers for this complete broadcast step."""
    try:
        manifest = read_manifest(step_dir)
    except (OSError, ValueError, KeyError):
        return False
    return manifest.serving and stored_nonce(manifest) == manifest.nonce


# ---- the weight store --------------------------------------------------------------------------


class BroadcastWeightStore(StepDirectoryStore):
    """`weights/step_N/` with a manifest instead of tensor files; same marker, listing and retention.

    `publish` is collective like the filesystem transport's, but only rank 0 sends: give every rank an
    iterator that yields all tensors on rank 0 and nothing elsewhere (`trainer/weights_broadcast.py`),
    the other ranks' iterators then only drive the gathers. They start draining once rank 0 has its
    workers (a key in `coordination`, the trainer's own store), so no collective of theirs waits on
    the orchestrator. `stop()` names a reason to give up waiting (DONE, a preemption): the step is then
    left unserved and `publish` returns; after the timeout it raises BroadcastError."""

    def __init__(self, folder: Path, host: str, timeout_s: float, backend: str = "gloo", device="cpu",
                 coordination=None, stop: Callable[[], str | None] = lambda: None):
        super().__init__(folder)
        self.host, self.timeout_s, self.backend, self.device = host, timeout_s, backend, device
        self.coordination, self.stop = coordination, stop
        self.last: dict = {}  # what the last publish did, for the trainer's log

    def publish(self, step: int, config: dict, buckets: Iterable[dict], group: RankGroup = SingleProcess()) -> Path:
        """Serve version `step` (step 0 is only announced: servers start from the model directory). An
        existing step is replaced, not kept as the filesystem transport does: its sender is gone."""
        serve = step > 0
        if group.rank != 0:
            if serve and group.world > 1 and self._agreed(step) != "go":
                serve = False
            for _ in buckets:  # drive the collectives rank 0's iterator needs
                pass
            return self.location(step)
        sender = Sender(self.host, self.timeout_s, self.backend, self.device) if serve else None
        manifest = sender.manifest(step) if sender else Manifest(step, self.host, 0, "", self.backend,
                                                                  self.timeout_s, serving=False)
        final = self._write(step, manifest, config)
        self.last = {"step": step, "served": False}
        if sender is None:
            for _ in buckets:
                pass
            return final
        try:
            sender.wait_workers(self.stop)
        except BroadcastError as exc:
            self._announce(step, "abort")
            for _ in buckets:
                pass
            if "weights.broadcast_timeout_s" in str(exc):
                raise
            self.last = {"step": step, "served": False, "why": str(exc)}
            return final
        self._announce(step, "go")
        joined = time.perf_counter()
        sender.start()
        for bucket in buckets:
            sender.send(bucket)
        sender.finish()
        self.last = {"step": step, "served": True, "workers": sender.workers, "bytes": sender.sent_bytes,
                     "send_s": time.perf_counter() - joined}
        return final

    def _announce(self, step: int, word: str) -> None:
        if self.coordination is not None:
            self.coordination.set(f"rlctl/weights_broadcast/{step}", word)

    def _agreed(self, step: int) -> str:
        if self.coordination is None:
            return "go"
        key = f"rlctl/weights_broadcast/{step}"
        self.coordination.wait([key], timedelta(seconds=self.timeout_s + 60))
        return self.coordination.get(key).decode()

    def _write(self, step: int, manifest: Manifest, config: dict) -> Path:
        def write(stage: Path) -> None:
            (stage / MANIFEST_FILE).write_text(json.dumps(manifest.to_json()) + "\n")
            (stage / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

        return publish_step(self.folder, step_dir_name(step), write,
                            {"step": step, "file": MANIFEST_FILE, "transport": "broadcast"}, sync_metadata=False)
