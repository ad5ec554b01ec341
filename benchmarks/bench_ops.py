"""chunked_cross_entropy and blocked attention vs their O(N*V) / O(N^2) peers, in one run.

Each case runs in its own subprocess so its peak memory is honest: the child
allocates its inputs, runs the operation (forward + backward) once to warm up
library buffers, resets the kernel's peak-RSS mark (VmHWM), runs it again and
reports the peak RSS growth over the warmed-up baseline. torch's CPU tensors
are invisible to tracemalloc, so RSS it is; glibc is told to mmap every block
over 64 KiB and to trim eagerly (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_),
so freed tensors leave the RSS and a warm heap cannot hide a peak. Times come
from a second child with glibc's defaults (those settings slow allocation):
the median of a few repeats after a warm-up.

    python benchmarks/bench_ops.py [--repeats R]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from floatguard.ops import attention, chunked_cross_entropy

N_CE, D_CE, V_CE = 4096, 512, 32768
N_ATT, D_ATT, HEADS = 4096, 64, 4


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _ce_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N_CE, D_CE, generator=g).requires_grad_(True)
    w = (torch.randn(V_CE, D_CE, generator=g) * 0.05).requires_grad_(True)
    t = torch.randint(0, V_CE, (N_CE,), generator=g)
    return h, w, t


def _att_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(  # type: ignore[return-value]
        torch.randn(HEADS, N_ATT, D_ATT, generator=g).requires_grad_(True) for _ in range(3)
    )


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) / D_ATT**0.5  # the O(N^2) path
    return torch.softmax(s, dim=-1) @ v


CASES: dict[str, Callable[[], Callable[[], None]]] = {}


def case(
    name: str,
) -> Callable[[Callable[[], Callable[[], None]]], Callable[[], Callable[[], None]]]:
    def register(fn: Callable[[], Callable[[], None]]) -> Callable[[], Callable[[], None]]:
        CASES[name] = fn
        return fn

    return register


@case("ce_full")
def _ce_full() -> Callable[[], None]:
    h, w, t = _ce_inputs()

    def run() -> None:
        h.grad = w.grad = None
        F.cross_entropy(h @ w.T, t).backward()

    return run


@case("ce_chunked")
def _ce_chunked() -> Callable[[], None]:
    h, w, t = _ce_inputs()

    def run() -> None:
        h.grad = w.grad = None
        chunked_cross_entropy(h, w, t, chunk_size=2048).backward()

    return run


@case("att_math_fwd")
def _att_math_fwd() -> Callable[[], None]:
    q, k, v = (x.detach() for x in _att_inputs())

    def run() -> None:
        _math_attention(q, k, v)

    return run


@case("att_blocked_fwd")
def _att_blocked_fwd() -> Callable[[], None]:
    q, k, v = (x.detach() for x in _att_inputs())

    def run() -> None:
        attention(q, k, v, block_size=128)

    return run


@case("att_math_train")
def _att_math_train() -> Callable[[], None]:
    q, k, v = _att_inputs()

    def run() -> None:
        q.grad = k.grad = v.grad = None
        _math_attention(q, k, v).sum().backward()

    return run


@case("att_blocked_train")
def _att_blocked_train() -> Callable[[], None]:
    q, k, v = _att_inputs()

    def run() -> None:
        q.grad = k.grad = v.grad = None
        attention(q, k, v, block_size=128)[0].sum().backward()

    return run


def child(name: str, repeats: int) -> None:
    """Memory mode (repeats == 0): peak RSS growth of one warmed-up run. Time mode: median."""
    run = CASES[name]()
    run()  # warm-up: one-time library buffers (BLAS, thread pools) are not the op's cost
    if repeats == 0:
        gc.collect()
        base = _status_kib("VmRSS")
        if _reset_peak():
            run()
            peak = _status_kib("VmHWM")
        else:  # no resettable mark: fall back to the lifetime high-water mark
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"peak_mib": (peak - base) / 1024}))
        return
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    print(json.dumps({"seconds": statistics.median(times)}))


def _child_run(name: str, repeats: int, env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", name, "--repeats", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure(name: str, repeats: int) -> dict[str, float]:
    """Peak memory in one child (glibc set to return freed blocks), time in another (defaults)."""
    mem_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    return {**_child_run(name, 0, mem_env), **_child_run(name, repeats, dict(os.environ))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.repeats)
        return
    print(f"# ops benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print(
        "| case | floatguard peak MiB | peer peak MiB | memory ratio "
        "| floatguard s | peer s | time ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = [
        (
            f"chunked_cross_entropy fwd+bwd (N={N_CE}, d={D_CE}, V={V_CE}, chunk 2048) "
            "vs F.cross_entropy(h @ W.T)",
            "ce_chunked",
            "ce_full",
        ),
        (
            f"attention fwd (N={N_ATT}, d={D_ATT}, {HEADS} heads, block 128) vs softmax(QK^T)V",
            "att_blocked_fwd",
            "att_math_fwd",
        ),
        (
            f"attention fwd+bwd (N={N_ATT}, d={D_ATT}, {HEADS} heads) vs softmax(QK^T)V",
            "att_blocked_train",
            "att_math_train",
        ),
    ]
    for label, ours_name, peer_name in rows:
        ours, peer = measure(ours_name, args.repeats), measure(peer_name, args.repeats)
        print(
            f"| {label} | {ours['peak_mib']:.0f} | {peer['peak_mib']:.0f} | "
            f"{ours['peak_mib'] / peer['peak_mib']:.3f}x | {ours['seconds']:.2f} | "
            f"{peer['seconds']:.2f} | {ours['seconds'] / peer['seconds']:.2f}x |"
        )


if __name__ == "__main__":
    main()
