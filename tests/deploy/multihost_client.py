"""The client side of tests/deploy/test_multihost.py, run inside the head's network namespace.

``python multihost_client.py ROUTER RAY_ADDRESS OUT.json``: asks the router for greedy answers,
looks at where the actors run, then keeps requests flowing while it scales the server from
1 prefill + 1 decode worker to 2 + 2 and back, and writes everything it saw to OUT.json for the
test to judge. It asserts nothing itself.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import ray

from pdserve.client import Client, RequestError
from pdserve.router.admin import scale

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "Say hello in Spanish.",
             "What is 2 + 2?", "Who wrote Romeo and Juliet?"]
NEW_TOKENS = 6
GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0)
NUM_CLIENTS = 3


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def held(total: dict, available: dict, name: str) -> float:
    return total.get(name, 0.0) - available.get(name, 0.0)


def resources_held() -> dict:
    total, available = ray.cluster_resources(), ray.available_resources()
    return {name: held(total, available, name) for name in ("host_a", "host_b")}


def main(target: str, ray_address: str, out_path: str) -> None:
    report: dict = {}
    ray.init(address=ray_address, namespace="pdserve", log_to_driver=False)
    with Client(target, timeout=120) as client:
        info = client.server_info()
        report["info"] = [info.mode, info.num_prefill_workers, info.num_decode_workers, info.transport]
        report["greedy"] = [client.complete(messages=chat(q), **GREEDY).token_ids for q in QUESTIONS]

    decode, prefill = ray.get_actor("pdserve-decode-0"), ray.get_actor("pdserve-prefill-0")
    report["decode_kv_address"] = ray.get(decode.kv_address.remote())
    report["prefill_transfers"] = ray.get(prefill.transfer_stats.remote())
    report["held_1p1d"] = resources_held()
    report["node_ips"] = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])

    # Requests keep flowing from NUM_CLIENTS threads while the server scales up and back down.
    results: list = []
    stop = threading.Event()

    def load(k: int) -> None:
        with Client(target, timeout=120) as c:
            i = k
            while not stop.is_set():
                q = i % len(QUESTIONS)
                try:
                    r = c.complete(messages=chat(QUESTIONS[q]), **GREEDY)
                    results.append({"q": q, "tokens": r.token_ids, "finish": r.finish_reason, "t": time.time()})
                except RequestError as exc:
                    results.append({"q": q, "error": f"{exc.code.name}: {exc.message}", "t": time.time()})
                i += NUM_CLIENTS

    threads = [threading.Thread(target=load, args=(k,)) for k in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        t0 = time.time()
        up = scale(target, prefill=2, decode=2, timeout=300)
        report["scale_up"] = {"s": time.time() - t0, "added": list(up.added), "removed": list(up.removed),
                              "counts": [up.num_prefill_workers, up.num_decode_workers]}
        with Client(target, timeout=30) as c:
            i2 = c.server_info()
            report["info_2p2d"] = [i2.num_prefill_workers, i2.num_decode_workers]
        report["held_2p2d"] = resources_held()
        # Let the new workers take part: wait until each has served something (or 60 s).
        new = {name: ray.get_actor(name) for name in up.added}
        served: dict = {}
        end = time.time() + 60
        while time.time() < end:
            for name, actor in new.items():
                if "prefill" in name:
                    served[name] = ray.get(actor.transfer_stats.remote())["transfers"]
                else:
                    served[name] = ray.get(actor.counters.remote()).decode_tokens
            if all(served.values()):
                break
            time.sleep(0.5)
        report["served_by_new"] = served
        report["new_kv_addresses"] = {n: ray.get(a.kv_address.remote()) for n, a in new.items() if "decode" in n}
        t0 = time.time()
        down = scale(target, prefill=1, decode=1, timeout=300)
        report["scale_down"] = {"s": time.time() - t0, "added": list(down.added), "removed": list(down.removed),
                                "counts": [down.num_prefill_workers, down.num_decode_workers],
                                "cut": down.num_requests_cut, "t_end": time.time()}
        end = time.time() + 15  # ray.kill returns before the actors' resources are free again
        while resources_held() != {"host_a": 1.0, "host_b": 1.0} and time.time() < end:
            time.sleep(0.2)
        report["held_after"] = resources_held()
        time.sleep(1.0)  # requests placed after the scale-down finish on the remaining workers
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    report["results"] = results
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
