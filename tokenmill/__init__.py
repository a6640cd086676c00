"""tokenmill: a small, fast LLM inference serving engine."""
from tokenmill.cpu_threads import apply_openmp_defaults

apply_openmp_defaults()  # before anything imports torch: OpenMP reads its settings once, at load

from tokenmill.llm import LLM  # noqa: E402
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
