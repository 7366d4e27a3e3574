#!/usr/bin/env python3
"""Closed-loop load on `keel answer`: C clients, each sending its next request as soon as it has
an answer, for SECONDS per client count. Prints throughput and latency per count, one JSON line
each. Used by bench/hilo/batching.sh.

    closed_loop.py ANSWER_URL SECONDS COUNTS [MAX_TOKENS]     (COUNTS: e.g. 1,32)
"""
import http.client
import json
import struct
import sys
import threading
import time
import urllib.parse
import os

def queries(path):
    raw = open(path, "rb").read()
    out, off = [], 0
    while off + 4 <= len(raw):
        d = struct.unpack_from("<i", raw, off)[0]
        if d <= 0 or off + 4 + d > len(raw):
            sys.exit(f"closed_loop: {path}: bad vector at byte {off}")
        out.append(list(raw[off + 4:off + 4 + d]))
        off += 4 + d
    return out

def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    url = urllib.parse.urlparse(sys.argv[1])
    secs = float(sys.argv[2])
    counts = [int(c) for c in sys.argv[3].split(",")]
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
    shared = os.environ.get("KEEL_SHARED", os.path.join(os.path.dirname(__file__), "../../../shared"))
    qs = queries(os.path.join(shared, "data/vectors/bigann10k_query.bvecs"))
    bodies = [json.dumps({"model": "answer", "messages": [{"role": "user", "content": "Tell me about it."}],
                          "max_tokens": max_tokens, "temperature": 0,
                          "keel_retrieval": {"vector": q}}) for q in qs]
    for c in counts:
        lat, errors, lock = [], [0], threading.Lock()
        stop = time.monotonic() + secs

        def client(k):
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
            i = k
            while time.monotonic() < stop:
                t0 = time.monotonic()
                conn.request("POST", "/v1/chat/completions", bodies[i % len(bodies)],
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                dt = time.monotonic() - t0
                with lock:
                    if r.status == 200:
                        lat.append(dt)
                    else:
                        errors[0] += 1
                i += c

        threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0
        if not lat:
            sys.exit(f"closed_loop: no request answered with {c} clients ({errors[0]} errors)")
        lat.sort()
        print(json.dumps({"clients": c, "answered": len(lat), "errors": errors[0],
                          "rate": len(lat) / elapsed, "mean_ms": 1000 * sum(lat) / len(lat),
                          "p50_ms": 1000 * lat[len(lat) // 2], "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))]}),
              flush=True)

main()
