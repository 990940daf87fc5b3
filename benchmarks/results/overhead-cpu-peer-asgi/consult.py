"""N consults of the routing peer of the running `kvtide serve` (direct mode), one at a time: p50 etc."""
import random
import sys

import kvtide.benchmarks.ttft_paths as tp

peer_port, _ = tp.direct_mode_ports(*tp.latest_haproxy_files())
rng = random.Random(1)
n, words = int(sys.argv[1]), int(sys.argv[2])
samples = [tp.consult_s(peer_port, tp.request_body(rng, "kvtide-demo", i, words))[0] for i in range(n)]
print("consult", tp.describe(samples[5:]))
