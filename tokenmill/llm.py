"""The offline API: `LLM(model=...).generate(prompts, params)`, as in vLLM."""
from __future__ import annotations

import gc

from tqdm.auto import tqdm

from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        if kwargs.get("num_scheduler_steps") is None:  # offline: nobody waits on a burst (sched/burst.py)
            kwargs["num_scheduler_steps"] = 0
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        # as the server's processes do: the model and imports live as long as the engine, and full collections
        # rescanning them took ~5 % of a long AWQ decode (perf, 2026-12-03)
        gc.collect()
        gc.freeze()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given none: the model's sampling defaults (generation_config.json,
        engine/generation_defaults.py), else SamplingParams() (vLLM's method)."""
        return SamplingParams(**self.llm_engine.input_processor.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        if lora_request is not None:  # (vLLM's argument; None is what every caller without LoRA passes)
            raise ValueError("LoRA adapters are not supported (lora_request must be None)")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if prompts is None or not hasattr(prompts, "__iter__"):
            raise ValueError("prompts must be a string, a dict, a list of token ids, or a list of those; got "
                             f"{type(prompts).__name__}")
        prompts = list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        if isinstance(params, tuple):  # any sequence, as vLLM takes
            params = list(params)
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError("'sampling_params' list must have one entry per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("'priority' list must have one entry per prompt")
        if priority is not None and any(priority) and self.llm_engine.config.scheduling_policy != "priority":
            # it would be ignored (vLLM refuses it too, as the server does)
            raise ValueError("'priority' needs scheduling_policy='priority'")
        engine = self.llm_engine
        ids = []
        try:
            for i, p in enumerate(prompts):
                sp = params[i] if isinstance(params, list) else params
                ids.append(engine.add_request(None, p, sp, priority=priority[i] if priority else 0))
        except Exception:
            engine.abort_request(ids)  # a bad prompt in the batch leaves nothing behind
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them. `tools` and `chat_template_kwargs`
        go to the chat template, as in vLLM. `continue_final_message` (with add_generation_prompt=False): the
        model continues the last message (e.g. an assistant answer's given start) instead of starting a new one."""
        import jinja2

        try:
            prompts = [self.llm_engine.input_processor.chat_prompt(conv, add_generation_prompt, chat_template, tools,
                                                                   chat_template_kwargs, continue_final_message)
                       for conv in _conversations(messages)]
        except (TypeError, KeyError, AttributeError, jinja2.TemplateError) as e:  # the template's own errors
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for out in engine.step(final_only=True):
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
            if not engine.has_unfinished_requests():
                engine.flush()  # a step sampled past a stop may still be in flight: it holds only finished requests
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]


def _conversations(messages) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them; a ValueError for anything else."""
    convs = [messages] if isinstance(messages, list) and messages and isinstance(messages[0], dict) else messages
    if not isinstance(convs, list) or not convs or not all(
            isinstance(c, list) and c and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in c)
            for c in convs):
        raise ValueError("messages must be a conversation (a list of {'role': str, 'content': ...} dicts) or a "
                         "list of conversations")
    return convs
