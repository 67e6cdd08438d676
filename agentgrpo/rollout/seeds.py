"""The one rule that gives an episode its seeds: `episode_seed`.

Training, evaluation and the rollout all call it, so which seed an episode gets is decided here
and nowhere else. A group is named by its draw (its place in the run's task stream, or a task's
index in an evaluation); its members share the env's reset seed (they start from one state) and
sample with seeds of their own, one per turn (engines seed a fresh generator per request).
"""

from __future__ import annotations

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: SplitMix64's increment


def _mix(seed: int, k: int) -> int:
    """SplitMix64's finalizer (Steele, Lea, Flood 2014) of `seed + k * golden` mod 2**64, shifted
    to 63 bits so it fits a signed int64 (SGLang's `sampling_seed`). Plain integer arithmetic:
    the same inputs give the same seed in every process and version (unlike the salted `hash()`).
    For one k it is a bijection of the 64-bit seed, so distinct seeds stay distinct (up to the
    dropped bit: a 2**-63 chance)."""
    z = (seed + k * _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def episode_seed(
    seed: int | None, *, draw: int | None = None, member: int = 0, turn: int = 1
) -> int | None:
    """The seed of one part of an episode, derived from `seed`.

    - `draw` given: `seed` is the run's (`RunConfig.seed`), and the result is the seed of the
      group drawn `draw`-th (member and turn as below, from that group seed). The group seed is
      every member's env reset seed and the base of their sampling seeds.
    - `draw` None: `seed` is the group's. Member `member` samples turn 1 with `seed + member` and
      turn k > 1 with a mix of (seed + member, k), so members differ on every turn and no turn
      repeats the random stream of another.

    None stays None (the engine's own generator). Examples: `episode_seed(run_seed, draw=p)` is
    group p's seed; `episode_seed(group_seed, member=i, turn=k)` is member i's turn-k seed.
    """
    if seed is None:
        return None
    if draw is not None:
        seed = _mix(seed, -1 - draw)  # negative keys: never the key of a turn (k >= 2)
    seed += member
    return seed if turn == 1 else _mix(seed, turn)
