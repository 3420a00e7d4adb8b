"""The tiny math recipe's Env: molt's math Env without its system prompt.

``MathEnv``'s system prompt is about 70 tokens of the tiny model's byte-level vocabulary, longer
than the problem and the answer together; a 2-layer model of width 128 learns the sums far worse
behind it (bench/RESULTS.md, the tiny math recipe). Everything else is ``MathEnv`` as shipped: the
answer from the last ``\\boxed{}``, graded by math-verify.
"""

from __future__ import annotations

from molt.agent_pool.envs.math import MathEnv


class TinyMathEnv(MathEnv):
    system_prompt = None
