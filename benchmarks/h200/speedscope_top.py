"""The hottest frames of a py-spy speedscope profile, by own and by total samples (run.sh's profiling stages).

    python3 benchmarks/h200/speedscope_top.py PROFILE.speedscope.json [SELF_ROWS] [TOTAL_ROWS]
"""

import collections
import json
import sys


def main(path: str, self_rows: int = 40, total_rows: int = 60) -> None:
    with open(path) as f:
        data = json.load(f)
    frames = data["shared"]["frames"]
    own, total = collections.Counter(), collections.Counter()
    n = 0
    for profile in data["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"]):
            n += weight
            if stack:
                own[stack[-1]] += weight
            for frame in set(stack):
                total[frame] += weight

    def name(i: int) -> str:
        frame = frames[i]
        return f'{frame["name"]} ({frame.get("file", "").split("site-packages/")[-1]}:{frame.get("line", "")})'

    print("total weight", n)
    print("## self")
    for frame, count in own.most_common(self_rows):
        print(f"{count / max(n, 1):6.1%} {name(frame)}")
    print("## total")
    for frame, count in total.most_common(total_rows):
        print(f"{count / max(n, 1):6.1%} {name(frame)}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:4]))
