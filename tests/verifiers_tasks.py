"""A task set written with the `verifiers` package's own classes, for tests/test_verifiers_env.py.

verifiers 0.4.0 ships no task set that runs offline (its built-ins need containers, hubs or extras), so
this one is built in memory: the prompt is 3 items of a digit sequence (`345`), the answer the next 2
(`67`); every character is in the tiny model's charset. Two weighted async `@vf.reward`s score the reply.
A module of its own so the orchestrator and its reward workers can import it by name (`module:attr`).
"""
from __future__ import annotations

import os

import verifiers.v1 as vf

DIGITS = "0123456789"


class SequenceData(vf.TaskData):
    answer: str = ""


class SequenceTaskConfig(vf.TaskConfig):
    log_path: str = ""
    """When set, every scored reply is appended here as `reply<TAB>reward`: proof the rubric ran."""


class SequenceTask(vf.Task[SequenceData, vf.State, SequenceTaskConfig]):
    @vf.reward(weight=0.25)
    async def first(self, task: SequenceData, trace) -> float:
        return float(trace.last_reply[:1] == task.answer[:1])

    @vf.reward(weight=0.75)
    async def exact(self, task: SequenceData, trace) -> float:
        score = float(trace.last_reply[:2] == task.answer)
        if self.config.log_path:
            total = 0.25 * (trace.last_reply[:1] == task.answer[:1]) + 0.75 * score
            line = f"{task.prompt}\t{trace.last_reply}\t{total}\n".encode()
            fd = os.open(self.config.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)  # one write with O_APPEND: lines of concurrent workers never interleave
            finally:
                os.close(fd)
        return score


class SequenceTasksetConfig(vf.TasksetConfig):
    task: SequenceTaskConfig = SequenceTaskConfig()
    size: int = 10
    system_prompt_text: str | None = None
    long_tasks: list[int] = []
    """Tasks whose prompt is the sequence's first 3 items repeated 20 times (too long for a small context)."""


class SequenceTaskset(vf.Taskset[SequenceTask, SequenceTasksetConfig]):
    def load(self):
        for start in range(self.config.size):
            seq = "".join(DIGITS[(start + i) % 10] for i in range(5))
            prompt = seq[:3] * (20 if start in self.config.long_tasks else 1)
            data = SequenceData(prompt=prompt, answer=seq[3:], system_prompt=self.config.system_prompt_text)
            yield SequenceTask(data, self.config.task)


def make_taskset(size: int = 3) -> SequenceTaskset:
    """A factory, the `load_environment(**kwargs)` style of referring to a task set."""
    return SequenceTaskset(SequenceTasksetConfig(size=size))


class SandboxTask(vf.Task[SequenceData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def in_box(self, task, trace, runtime) -> float:  # needs a runtime: skipped offline
        return 1.0


class SandboxTaskset(vf.Taskset[SandboxTask, vf.TasksetConfig]):
    def load(self):
        yield SandboxTask(SequenceData(prompt="123", answer="45"), self.config.task)


class Lookup(vf.Toolset):
    @vf.tool
    async def lookup(self, key: str) -> str:
        """The value of `key`."""
        return key


class ToolTask(SequenceTask):
    @classmethod
    def toolsets(cls, config):
        return [Lookup(vf.ToolsetConfig())]


class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        yield ToolTask(SequenceData(prompt="123", answer="45"), self.config.task)


class EndlessTaskset(vf.Taskset[SequenceTask, SequenceTasksetConfig]):
    INFINITE = True

    def load(self):
        start = 0
        while True:
            seq = "".join(DIGITS[(start + i) % 10] for i in range(5))
            yield SequenceTask(SequenceData(prompt=seq[:3], answer=seq[3:]), self.config.task)
            start += 1
