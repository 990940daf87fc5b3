"""A burst of N concurrent consults (480 words) against the running peer: time to each answer."""
import asyncio, random, statistics, sys, time
from kvtide.benchmarks.ttft_paths import direct_mode_ports, latest_haproxy_files, request_body
peer, _ = direct_mode_ports(*latest_haproxy_files())
N = int(sys.argv[1]) if len(sys.argv) > 1 else 64
rng = random.Random(3)
async def one(body):
    r, w = await asyncio.open_connection("127.0.0.1", peer)
    t0 = time.perf_counter()
    w.write(b"POST /internal/route HTTP/1.0\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await w.drain()
    await r.read()
    w.close()
    return time.perf_counter() - t0
async def main():
    serial = 0
    for rep in range(6):
        bodies = []
        for i in range(N):
            serial += 1; bodies.append(request_body(rng, "kvtide-demo", 100000 * rep + serial, 480))
        t0 = time.perf_counter()
        ts = await asyncio.gather(*(one(b) for b in bodies))
        total = time.perf_counter() - t0
        ts = sorted(t * 1e3 for t in ts)
        print(f"burst {N}: last answer {total*1e3:.1f} ms, p50 {statistics.median(ts):.1f}, per consult {total*1e3/N:.2f} ms", flush=True)
        await asyncio.sleep(0.5)
asyncio.run(main())
