"""A model of a round on Flower's simulation engine: the engine's fixed dispatch tick and
the ServerApp's Grid poll, as two loops, and nothing else.

Run ``python benchmarks/tick_model.py`` (``--help`` for the phases; a few seconds). It
answers two questions about ``bench_flower_round.py`` that its measurements alone cannot:

* how much a millisecond more in the clients or the server phase costs a round, at a
  poll of 0.10 s and of 0.05 s (the engine's tick being 0.1 s);
* whether drawing every round's phase uniformly (``--phase round`` in that benchmark)
  estimates what a run of rounds averages. It does not: a run's rounds lock to the tick,
  so the phase they push at is not uniform, and the ratio differs.

The model. The engine looks for instructions every ``tick`` s plus ``tick_work`` s (its
own loop's work). A round pushed at ``p`` is dispatched at the first tick at or after
``p``; its train calls start ``ray`` s later (uniform in 0.5-1.5 x) and end ``clients``
s after that (plus up to ``jitter`` s); the ServerApp pulls at ``p + k * poll`` for k = 1,
2, ... and sees the replies at the first pull after they ended; it pushes the next round
``server`` s after that (0.8-1.2 x). Defaults: the phases measured at N = 10 on a 2-core
machine (``bench_flower_round.py``'s "where a round goes" table).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics


def mean_round(
    clients: float,
    server: float,
    poll: float,
    *,
    tick: float = 0.1,
    tick_work: float = 0.0005,
    ray: float = 0.01,
    jitter: float = 0.01,
    rounds: int = 50_000,
    uniform_phase: bool = False,
    seed: int = 1,
) -> float:
    """Mean seconds per round of the model (see the module docstring). ``uniform_phase``:
    every push first waits a uniform part of a tick, not counted (the benchmark's
    ``--phase round``)."""
    rng = random.Random(seed)
    period = tick + tick_work
    push = rng.uniform(0.0, tick)
    lengths = []
    for _ in range(rounds):
        if uniform_phase:
            push += rng.uniform(0.0, tick)
        dispatched = math.ceil(push / period) * period
        ended = dispatched + ray * rng.uniform(0.5, 1.5) + clients + rng.uniform(0.0, jitter)
        pulled = push + poll * max(1, math.ceil((ended - push) / poll))
        following = pulled + server * rng.uniform(0.8, 1.2)
        lengths.append(following - push)
        push = following
    return statistics.fmean(lengths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=float, nargs=2, default=[0.043, 0.047],
                        metavar=("FEDAVG", "LENSEMBLE"), help="clients phase, s")
    parser.add_argument("--server", type=float, nargs=2, default=[0.002, 0.007],
                        metavar=("FEDAVG", "LENSEMBLE"), help="server phase, s")
    parser.add_argument("--rounds", type=int, default=50_000)
    args = parser.parse_args(argv)
    (cf, cl), (sf, sl) = args.clients, args.server
    print(f"clients phase FedAvg {cf * 1e3:.1f} ms, lensemble {cl * 1e3:.1f} ms; server "
          f"phase {sf * 1e3:.1f} / {sl * 1e3:.1f} ms; engine tick 0.1 s")
    print(f"{'poll':>6}{'run of rounds':>15}{'uniform phase':>15}{'-1 ms server':>14}"
          f"{'-1 ms clients':>15}")
    for poll in (0.1, 0.05):
        def ratio(c: float, s: float, uniform: bool = False, p: float = poll) -> float:
            lens = mean_round(c, s, p, rounds=args.rounds, uniform_phase=uniform)
            fed = mean_round(cf, sf, p, rounds=args.rounds, uniform_phase=uniform)
            return lens / fed

        print(f"{poll:>6.2f}{ratio(cl, sl):>15.3f}{ratio(cl, sl, True):>15.3f}"
              f"{ratio(cl, sl - 0.001):>14.3f}{ratio(cl - 0.001, sl):>15.3f}")
    print("(ratios lensemble / FedAvg of the mean seconds per round; 'run of rounds': each "
          "round pushes where the last one left off, as in a run; 'uniform phase': every "
          "push at a uniformly drawn phase of the tick)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
