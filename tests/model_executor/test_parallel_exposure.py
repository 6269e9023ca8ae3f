"""What a multi-rank engine exposes on the network (issue 47, finding 10): with the `mp` backend (one machine) the
rendezvous TCPStore (unauthenticated) and gloo's sockets listen on loopback only, and on the CPU the store is gone
once the groups are built. Read from the kernel's own socket tables (/proc/net/tcp, tcp6) for the engine process and
its worker ranks, on a real tp=2 x pp=2 engine that then still generates."""
from __future__ import annotations

import ipaddress
import os

import pytest
from hf_reference import mixed_prompts

from test_parallel import engine, generate

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # the kernel prints each 32-bit word in host (little-endian) order
    return str(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))


def listening_sockets(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of `pids` holds open."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                    address, port = local.split(":")
                    found.add((_address(address), int(port, 16)))
    return found


def test_mp_ranks_listen_on_loopback_only_and_drop_the_store(tiny_model_dir, tiny_tokenizer):
    before = listening_sockets([os.getpid()])
    with engine(tiny_model_dir("llama"), tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        executor = llm.llm_engine.executor
        ranks = [os.getpid(), *executor.worker_pids.values()]
        listening = listening_sockets(ranks) - before
        assert listening, "gloo's pair listeners should show"
        exposed = [(a, p) for a, p in listening if not ipaddress.ip_address(a).is_loopback]
        assert exposed == [], f"listening beyond loopback: {exposed}"
        assert executor.driver.model.parallel.store is None  # the rendezvous server is closed
        prompts = mixed_prompts(tiny_tokenizer, n=4)
        assert all(len(o.token_ids) == 16 for o in generate(llm, prompts))  # the groups work without it
