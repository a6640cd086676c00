"""tokenmill: a small, fast LLM inference serving engine."""
from tokenmill.cpu_malloc import apply_malloc_defaults
from tokenmill.cpu_threads import apply_openmp_defaults

apply_openmp_defaults()  # before anything imports torch: OpenMP reads its settings once, at load
apply_malloc_defaults()  # tensor-sized blocks stay in the heap, warm (cpu_malloc.py)

from tokenmill.llm import LLM  # noqa: E402
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
