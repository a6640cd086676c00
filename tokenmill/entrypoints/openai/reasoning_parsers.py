"""A thinking model's reasoning, split from its answer (`--reasoning-parser NAME`, vLLM's flag): the chat
message's `reasoning_content` and `content`, whole or streamed.

    deepseek_r1  [<think>] reasoning </think> content      the output opens in reasoning (R1's template puts
                                                          <think> in the prompt); no </think>: all reasoning
    qwen3        <think> reasoning </think> content        reasoning only where the output opens with <think>
                                                          (Qwen3 with enable_thinking); otherwise all content

Streaming gives the same split as the whole text: text that may be the start of a tag is held back until it is
clear. A request whose output is held to a grammar (structured outputs, forced tool calls) gets it after the
reasoning: the grammar starts once the output has the end tag's tokens (StructuredOutputsParams.start_after),
except where the prompt shows the model will not think (Qwen3 with enable_thinking off)."""
from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers import _partial_suffix


class ReasoningParser:
    START, END = "<think>", "</think>"
    opens_in_reasoning = True  # without a start tag, the output is reasoning until the end tag

    def __init__(self):
        self.mode = "start"  # "start" (undecided) -> "reasoning" -> "content"

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content), either None where absent."""
        lead = text.lstrip()
        opened = lead.startswith(self.START)
        if not opened and not self.opens_in_reasoning:
            return None, text
        body = lead[len(self.START):] if opened else text
        reasoning, sep, content = body.partition(self.END)
        return reasoning, (content or None) if sep else None

    def stream(self, buffer: str, finished: bool) -> tuple[str, str, str]:
        """(reasoning to send, content to send, text to keep) from the unsent `buffer`."""
        if self.mode == "start":
            lead = buffer.lstrip()
            if not finished and self.START.startswith(lead):  # (empty, or the start tag's first part)
                return "", "", buffer
            if lead.startswith(self.START):
                self.mode, buffer = "reasoning", lead[len(self.START):]
            else:
                self.mode = "reasoning" if self.opens_in_reasoning else "content"
        if self.mode == "content":
            return "", buffer, ""
        end = buffer.find(self.END)
        if end >= 0:
            self.mode = "content"
            return buffer[:end], buffer[end + len(self.END):], ""
        keep = 0 if finished else _partial_suffix(buffer, self.END)
        return buffer[:len(buffer) - keep], "", buffer[len(buffer) - keep:]


    @classmethod
    def thinks_first(cls, prompt: str) -> bool:
        """Whether the output to `prompt` opens with a reasoning section, which a grammar must wait out."""
        return cls.opens_in_reasoning


class DeepSeekR1Parser(ReasoningParser):
    opens_in_reasoning = True


class Qwen3Parser(ReasoningParser):
    opens_in_reasoning = False

    @classmethod
    def thinks_first(cls, prompt: str) -> bool:
        # with enable_thinking off, Qwen3's template closes an empty <think></think> in the prompt itself
        return not prompt.rstrip().endswith(cls.END)


REASONING_PARSERS = {"deepseek_r1": DeepSeekR1Parser, "qwen3": Qwen3Parser}


class Reasoning:
    """One request's reasoning split: whole messages, or each choice's stream."""

    def __init__(self, parser_name: str):
        self.make = REASONING_PARSERS[parser_name]
        self.streams: dict[int, ReasoningParser] = {}
        self.pending: dict[int, str] = {}

    def split(self, text: str) -> tuple[str | None, str | None]:
        return self.make().extract(text)

    def stream(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of choice `index`'s new text."""
        parser = self.streams.get(index) or self.streams.setdefault(index, self.make())
        reasoning, content, self.pending[index] = parser.stream(self.pending.get(index, "") + text, finished)
        return reasoning, content
