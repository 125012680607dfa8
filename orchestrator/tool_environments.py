"""Multi-turn tool environments. `tool_lookup`: a task the policy can only solve by calling a tool.

The prompt names a key, e.g. `k3`. Each prompt has its own hidden table (key -> value digit), so no
answer can be memorised: the policy must call the tool in its first turn by naming the key (`3`,
followed by `call_suffix` if one is set, e.g. `3?`), the environment answers with the value (`=7`,
tokens the policy is not trained on; `=?` to a malformed call), and the second turn must repeat it
(`7`). Reward: `call_key_credit` for asking the prompt's key, `call_format_credit` for the suffix, the
rest for the right final answer.

The demo's call is the bare key, right after the prompt's key: a randomly initialised 2-layer model
learns to copy an adjacent token within a few dozen steps, but with a suffix (`3?`) or a prefix
(`#3` after `k3?`) the replay (bench/replay_tools_recipe.py) locked onto the constant character and
the reward stayed at the format credit for 60 steps.

Every character is in the tiny model's charset, so a randomly initialised tiny model learns it on CPU
(recipes/tiny-tools-cpu.toml; settings chosen with bench/replay_tools_recipe.py).
"""
from __future__ import annotations

import json
import random
import string

from rlctl.orchestrator.environments import MultiTurnEnvironment, Prompt
from rlctl.recipes.errors import RecipeError

REPLY, UNKNOWN = "=", "?"


class ToolLookupEnvironment(MultiTurnEnvironment):
    reward_inline = True  # a few string comparisons: scored on the loop, no worker pool

    def __init__(self, keys: int = 10, call_suffix: str = "", call_format_credit: float = 0.0,
                 call_key_credit: float = 0.3):
        if not 1 <= keys <= 10:
            raise RecipeError(f"keys must be in 1..10 (got {keys!r})", key="orchestrator.environment.args.keys")
        if not (0 <= call_format_credit and 0 <= call_key_credit and call_format_credit + call_key_credit <= 1):
            raise RecipeError("call_format_credit and call_key_credit must be >= 0 and sum to <= 1 (got "
                              f"{call_format_credit!r}, {call_key_credit!r})", key="orchestrator.environment.args")
        self.keys = string.digits[:keys]
        self.call_suffix = call_suffix
        self.call_format_credit = call_format_credit
        self.call_key_credit = call_key_credit

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            key = rng.choice(self.keys)
            table = "".join(rng.choice(string.digits) for _ in self.keys)  # value of key i at position i
            out.append(Prompt(f"k{key}", table[int(key)], {"key": key, "table": table}))
        return out

    def reply(self, prompt: Prompt, call: str) -> str:
        """What the tool answers to the first turn `call`."""
        if call and call[0] in self.keys and call[1:].startswith(self.call_suffix):
            return REPLY + prompt.info["table"][int(call[0])]
        return REPLY + UNKNOWN

    async def rollout(self, client, prompt: Prompt, budget):
        traj = client.new_trajectory(prompt.text, budget)
        call = await client.generate(traj)
        answer = ""
        if traj.can_generate():
            reply = self.reply(prompt, call.text)
            if traj.add_environment(await client.tokenize(reply), reply) and traj.can_generate():
                answer = (await client.generate(traj)).text
        traj.reward_text = json.dumps({"call": call.text, "answer": answer})
        return traj

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        try:
            parts = json.loads(completion_text)
            call, answer = str(parts["call"]), str(parts["answer"])
        except (ValueError, TypeError, KeyError):
            return 0.0  # not a transcript of this environment
        score = self.call_format_credit * call[1:].startswith(self.call_suffix)  # each part learns on its own
        score += self.call_key_credit * call.startswith(prompt.info["key"])
        score += (1 - self.call_format_credit - self.call_key_credit) * answer.startswith(prompt.target)
        return score
