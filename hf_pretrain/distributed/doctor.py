"""`hf-pretrain doctor --distributed`: what every rank runs, and whether the ranks can talk.

Run it under the same launcher and settings as the training job, e.g.

    accelerate launch --config_file two_nodes.yaml -m hf_pretrain.cli doctor --distributed
    torchrun --nnodes 2 --nproc_per_node 8 ... -m hf_pretrain.cli doctor --distributed

Each rank:
1. checks that the rendezvous (`MASTER_ADDR:MASTER_PORT`) answers before joining: a refused
   connection means nothing listens there (rank 0 not started, wrong address or port), a timeout
   means packets are dropped (a firewall); rank 0 checks that it can bind the port;
2. joins the process group (NCCL on GPUs, gloo on CPUs) with a short timeout;
3. reports host, versions (torch, CUDA, NCCL, transformers, accelerate, deepspeed, hf_pretrain),
   GPU model, driver and clocks (NVML through `telemetry/sensors.py`: "unavailable" when not
   exposed), and the environment variables that decide NCCL's behaviour (socket interface, IB,
   P2P, timeouts), flagging an interface name that does not exist on that host;
4. times an all-reduce over all ranks and a ping-pong between rank 0 and every other rank (a
   link), so one slow NIC or node stands out.
Rank 0 prints one table, the links, and every mismatch across ranks (versions, GPU, driver, the
NCCL variables). Exit code 1 when something is flagged.

Written by hand: torch/accelerate offer `collect_env` per process, not a cross-rank comparison
or link timings.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

PACKAGES = ("transformers", "accelerate", "deepspeed", "hf_pretrain")
NCCL_VARIABLES = (
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_P2P_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_DEBUG",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "TORCH_DIST_INIT_BARRIER",
)
COMPARED = ("torch", "cuda", "nccl", "transformers", "accelerate", "deepspeed", "hf_pretrain", "gpu", "driver")


@dataclass
class RankFacts:
    rank: int
    local_rank: int
    host: str
    torch: str
    cuda: str
    nccl: str
    transformers: str
    accelerate: str
    deepspeed: str
    hf_pretrain: str
    gpu: str
    driver: str
    sm_clock_mhz: str
    environment: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)


def probe_port(host: str, port: int, timeout: float = 3.0) -> str:
    """ "open", "refused" (nothing listens) or "timeout" (packets dropped) for a TCP connect."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as err:
        return f"error: {err.strerror or err}"


def wait_for_rendezvous(host: str, port: int, seconds: float = 30.0) -> str:
    """Probe until the port answers or `seconds` pass (rank 0 may start a little later)."""
    deadline, state = time.monotonic() + seconds, "timeout"
    while time.monotonic() < deadline:
        state = probe_port(host, port, timeout=min(3.0, max(deadline - time.monotonic(), 0.1)))
        if state == "open":
            return state
        time.sleep(0.5)
    return state


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def interface_problems(environment: dict[str, str]) -> list[str]:
    """Socket interfaces named in the environment that this host does not have."""
    names = {name for _, name in socket.if_nameindex()}
    problems = []
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = environment.get(variable)
        if not value:
            continue
        wanted = [v.lstrip("^=") for v in value.split(",") if v and not v.startswith("^")]
        if wanted and not any(name.startswith(w) for w in wanted for name in names):
            problems.append(f"{variable}={value} matches no interface here (have: {', '.join(sorted(names))})")
    return problems


def collect_facts(rank: int, local_rank: int) -> RankFacts:
    from ..telemetry.sensors import open_sensors

    gpu = driver = clock = "unavailable"
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(local_rank)
        sensors = open_sensors(torch.device("cuda", local_rank))
        sm = sensors.read().get("gpu_sm_clock_mhz")
        clock = f"{sm:.0f}" if isinstance(sm, (int, float)) else "unavailable"
        if hasattr(sensors, "nvml"):
            version = sensors.nvml.nvmlSystemGetDriverVersion()
            driver = version.decode() if isinstance(version, bytes) else str(version)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
    environment = {name: os.environ[name] for name in NCCL_VARIABLES if name in os.environ}
    return RankFacts(
        rank=rank,
        local_rank=local_rank,
        host=socket.gethostname(),
        torch=torch.__version__,
        cuda=torch.version.cuda or "cpu",
        nccl=nccl,
        **{package: _version(package) for package in PACKAGES},
        gpu=gpu,
        driver=driver,
        sm_clock_mhz=clock,
        environment=environment,
        problems=interface_problems(environment),
    )


def find_mismatches(facts: list[RankFacts]) -> list[str]:
    """Every compared field and NCCL variable that differs across ranks, with who has what."""
    out = []
    for name in COMPARED:
        values: dict[str, list[int]] = {}
        for f in facts:
            values.setdefault(str(getattr(f, name)), []).append(f.rank)
        if len(values) > 1:
            out.append(f"{name} differs: " + "; ".join(f"{v} on ranks {ranks}" for v, ranks in values.items()))
    for variable in NCCL_VARIABLES:
        values = {}
        for f in facts:
            values.setdefault(f.environment.get(variable, "(unset)"), []).append(f.rank)
        if len(values) > 1:
            out.append(f"{variable} differs: " + "; ".join(f"{v} on ranks {ranks}" for v, ranks in values.items()))
    return out


def time_all_reduce(device: torch.device, megabytes: float = 4.0, repeats: int = 5) -> float:
    """Median seconds of an all-reduce of `megabytes` over all ranks."""
    tensor = torch.ones(int(megabytes * 2**20 / 4), device=device)
    dist.all_reduce(tensor)  # warm-up (and connection set-up)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def time_links(device: torch.device, megabytes: float = 1.0, repeats: int = 3) -> dict[int, float]:
    """Median round-trip seconds between rank 0 and each other rank (one link at a time)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor = torch.ones(int(megabytes * 2**20 / 4), device=device)
    out = {}
    for peer in range(1, world):
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(tensor, peer)
                dist.recv(tensor, peer)
            elif rank == peer:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)
            _sync(device)
            times.append(time.perf_counter() - start)
        out[peer] = sorted(times[1:])[len(times[1:]) // 2]
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_report(facts: list[RankFacts], all_reduce_s: float, links: dict[int, float], megabytes: float) -> str:
    columns = [("rank", 4), ("host", 16), ("torch", 12), ("cuda", 6), ("nccl", 8), ("transformers", 12)]
    columns += [("accelerate", 10), ("deepspeed", 9), ("hf_pretrain", 11), ("gpu", 22), ("driver", 12)]
    columns += [("sm_clock_mhz", 12)]
    rows = [" ".join(f"{name:<{width}}" for name, width in columns)]
    for f in facts:
        rows.append(" ".join(f"{str(getattr(f, name))[:width]:<{width}}" for name, width in columns))
    bandwidth = 2 * megabytes / all_reduce_s / 1024 if all_reduce_s else 0
    rows.append(
        f"all-reduce of {megabytes:g} MB over {len(facts)} ranks: {all_reduce_s * 1e3:.2f} ms (~{bandwidth:.2f} GB/s algorithm bandwidth)"
    )
    if links:
        median = sorted(links.values())[len(links) // 2]
        for peer, seconds in sorted(links.items()):
            slow = "  <- slow link" if seconds > 4 * median else ""
            rows.append(f"link 0 <-> {peer} ({facts[peer].host}): round trip {seconds * 1e3:.2f} ms{slow}")
    environment = facts[0].environment
    rows.append(
        "NCCL/gloo variables on rank 0: " + (", ".join(f"{k}={v}" for k, v in environment.items()) or "none set")
    )
    return "\n".join(rows)


def run_doctor(timeout_s: float = 60.0, megabytes: float = 4.0) -> int:
    """Run on every rank under a launcher; rank 0 prints the report. Returns the exit code."""
    if "WORLD_SIZE" not in os.environ:
        print(
            "doctor --distributed runs under the launcher, e.g.\n"
            "  accelerate launch --config_file CONFIG.yaml -m hf_pretrain.cli doctor --distributed\n"
            "  torchrun --nproc_per_node 2 -m hf_pretrain.cli doctor --distributed"
        )
        return 2
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500))
    if rank != 0:
        state = wait_for_rendezvous(host, port, timeout_s / 2)
        if state != "open":
            hint = {
                "refused": "nothing listens there: is rank 0 running, and are MASTER_ADDR / main_process_ip and the port right?",
                "timeout": "no answer: a firewall drops the packets, or the address is not reachable from this host",
            }.get(state, "")
            print(f"rank {rank} on {socket.gethostname()}: rendezvous {host}:{port} {state}. {hint}", flush=True)
            return 1
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    import datetime

    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        facts = collect_facts(rank, local_rank)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, asdict(facts))
        all_facts = [RankFacts(**f) for f in gathered]
        all_reduce_s = time_all_reduce(device, megabytes)
        links = time_links(device)
        problems = find_mismatches(all_facts) + [f"rank {f.rank}: {p}" for f in all_facts for p in f.problems]
        if rank == 0:
            print(format_report(all_facts, all_reduce_s, links, megabytes))
            print("\n".join(f"FLAG: {p}" for p in problems) if problems else "no mismatch across ranks", flush=True)
        dist.barrier()
        return 1 if problems else 0
    finally:
        dist.destroy_process_group()
