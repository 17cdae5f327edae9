"""Verifier options (flags, PDFLASH_* environment variables, or a config file: pdflash.config)."""

from __future__ import annotations

import dataclasses
import pathlib

from pdflash.config import ConfigError, ServerOptions, option

#: --max-wave-sessions auto (0) on CUDA: the sessions measured (benchmarks/waves.py --sessions 1 2 4 8)
AUTO_WAVE_SESSIONS = 8


@dataclasses.dataclass
class VerifierConfig(ServerOptions):
    model: str = option("", "target checkpoint directory (config.json + *.safetensors); empty = the embedded demo model")
    port: int = option(50053, "port to bind (0 = pick a free one)")
    device: str = option("auto", "torch device: auto, cpu, cuda, cuda:N")
    dtype: str = option("auto", "auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    kernels: str = option("auto", "batch-invariant Triton kernels for every forward (exact greedy output at every block width): auto (on CUDA when triton is importable), on, off")
    paged_kv: str = option("auto", "the paged KV pool and layer-by-layer forward (CUDA graphs per block-size bucket): auto (with the kernels), on, off (transformers' DynamicCache)")
    kv_cache_gb: float = option(0.0, "size of the paged KV pool in GiB (0 = a quarter of the free GPU memory; 0.25 on a CPU)")
    cuda_graphs: bool = option(True, "replay verify forwards from CUDA graphs (paged KV on CUDA)")
    prefill_graphs: bool = option(True, "replay prefill forwards (prompts and --prefill-chunk chunks of up to 512 tokens) from CUDA graphs too, a graph per bucket of 32-512 rows captured by the warm-up: the same bits, without the eager forward's ~20-30 ms of host time")
    experts: str = option("native", "routed experts: native (the checkpoint's dtype) or mxfp4 (quantized at load; resident on the device, or offloaded with --expert-cache-gb)")
    expert_cache_gb: float = option(0.0, "offload the MXFP4 experts to a host store and serve them from a device cache of this many GiB (fractions allowed; 0 = every expert resident)")
    expert_prefetch: str = option("union,layer", "offloaded experts, what streams in ahead of need: union (a verify's projected union when it arrives), layer (at each layer, the experts the next layer's router picks for this layer's input), union,layer, or none")
    expert_cache_mode: str = option("device", "offloaded experts, who decides what the cache holds: device (every decision and copy inside the forward's CUDA graph, no host step) or host (the forward stops at every layer for the host's cache)")
    expert_eviction: str = option("lru", "offloaded experts with --expert-cache-mode host, which cached expert a miss replaces: lru (least recently used) or cyclic (experts not routed at their layer's latest lookup first, then those of the layer whose turn in the forward comes last; benchmarks/cache_policy.py)")
    expert_arrival_share: float = option(0.5, "offloaded experts with union prefetch: when a Verify arrives (or the scheduler hints an admitted demand: Prefetch), the most of the cache's slots (device mode: of each layer's, and of all) its projected union may take before its forward; 0 = nothing ahead of the forward")
    expert_fill_overlap: bool = option(True, "offloaded experts in the device-managed cache: copy a layer's missing experts on a side stream while its resident experts' GEMMs run, then run the missing ones (the same bits; --no-expert-fill-overlap: copy first, then every GEMM)")
    expert_guess_width: int = option(0, "offloaded experts with layer prefetch: how many of the next layer's router picks per token its guess fetches while this layer computes (0 = auto: a quarter of the router's top_k, at least 1; fewer, surer guesses waste fewer PCIe bytes)")
    torch_threads: int = option(0, "CPU threads for torch (0 = automatic: all cores, or all but one with --colocated)")
    prefill_threads: int = option(0, "CPU threads for prefill forwards (0 = as the verify forwards)")
    colocated: bool = option(False, "the drafter and scheduler share this machine: the verifier's forwards leave them a core (pdflash up and compose set it)")
    inline_verify: str = option("auto", "run verify forwards on the server's event-loop thread: auto (when they run on a CPU with one thread), on, off; saves two thread hand-offs per round, blocks the loop for the forward")
    warmup: str = option("auto", "before health turns SERVING, run a short prefill and one verify per CUDA-graph bucket (with and without the drafter's feature layers) so the first request pays no first-use costs (Triton compiles, graph captures, expert-cache fills), then give back what it used: auto (on CUDA), on, off", switch=True)
    warmup_feature_layers: str = option("auto", "target layers whose outputs the warm-up asks for, as a DFlash drafter's Prefill does: auto (the layers the default DFlash drafter of --model reads: the embedded drafter's for the embedded target, none for any other), none, or a comma list such as 1,3,5 (in the drafter's order)")
    max_sessions: int = option(64, "sessions held at once; beyond it Prefill answers RESOURCE_EXHAUSTED")
    session_ttl_s: float = option(120.0, "an idle session is ended after this many seconds")
    max_block_size: int = option(32, "largest verify block (anchor + drafts)")
    prefill_chunk: int = option(0, "prompt tokens one prefill forward takes on the paged KV (0 = the whole prompt at once): between a long prompt's chunks the verifies waiting for the device run, so sessions already decoding are not stalled behind it; the session is bit-identical either way")
    max_wave_sessions: int = option(0, "multi-session verify waves: the Verify calls of up to this many sessions that wait for the device share one forward (on the paged KV: one ragged forward, each session's answer bit-identical to a verify of its own; on transformers' cache: one after another); so do up to this many prompts waiting to be prefilled (prefill waves); 1 = each verify and prompt its own forward; 0 = auto: 8 on CUDA, 1 on a CPU")
    max_tokens_limit: int = option(4096, "largest max_tokens a request may ask for")
    max_pending: int = option(128, "Prefill/Verify calls waiting for the device at once; beyond it RESOURCE_EXHAUSTED with a retry delay")
    metrics_port: int = option(9103, "Prometheus /metrics HTTP port (0 = any free port, -1 = off)")
    ticket_secret: str = option("", "HMAC-SHA256 key shared with the scheduler: when set, Verify needs a valid, unexpired admission ticket", secret=True)

    def thread_counts(self, cores: int) -> tuple[int, int]:
        """(verify, prefill) CPU threads; 0 = torch's default (prefill: as verify). Explicit settings win over --colocated.

        Co-located on a small CPU host, the drafter's, scheduler's and clients' work of a round runs while
        the forward runs: measured on 2 cores (benchmarks/README.md), a one-thread verify forward beat a
        two-thread one through the stack, whose second thread kept being preempted by that work. Prefill
        too: a two-thread prompt forward took 12-13 ms alone but 13-73 ms (mean 15-22) between the other
        services' work, and the stack was 2% faster with one-thread prefill (A/B, benchmarks/README.md).
        """
        verify = self.torch_threads or (max(1, cores - 1) if self.colocated else 0)
        return verify, self.prefill_threads

    def verify_inline(self, device_type: str, verify_threads: int) -> bool:
        """Whether verify forwards run on the event-loop thread (`verify_threads`: as thread_counts gave, 0 = torch's
        default, i.e. every core).

        A CPU forward with one thread holds the GIL for most of its run anyway, so the loop could do little
        meanwhile; handing it to the torch thread costs two thread wake-ups per round (measured on 2 cores
        through the stack: ~4% of n-gram throughput, benchmarks/README.md). With more threads the forward
        stays on the torch thread, which owns the OpenMP team (pdflash.torch_thread says why there is one).
        """
        if self.inline_verify == "on":
            return True
        if self.inline_verify == "off":
            return False
        return device_type == "cpu" and verify_threads == 1

    def wave_sessions(self, device_type: str, wave_forward: bool = True) -> int:
        """--max-wave-sessions resolved: 0 (auto) = AUTO_WAVE_SESSIONS on CUDA where a wave is one ragged forward
        (`wave_forward`: the paged KV with a position-table RoPE) that reads each weight once for all its sessions (H100,
        block 8, 8 sessions: 3.67x the tok/s of one verify after another on gptoss-24l, 2.03x on qwen3-8l;
        benchmarks/results/waves_h100.md); else 1 (a wave would be its verifies one after another). A lone waiting call
        is a plain verify either way."""
        if self.max_wave_sessions:
            return self.max_wave_sessions
        return AUTO_WAVE_SESSIONS if device_type == "cuda" and wave_forward else 1

    def warmup_wanted(self, device_type: str) -> bool:
        """Whether the verifier warms up before serving (verifier_svc.warmup). auto: on CUDA, where a first request
        paid ~2 s of first uses (Triton JIT, graph captures, expert-cache fills; ~200 ms warm, gpt-oss on the H200);
        off on a CPU, whose forwards have no such costs worth the start-up time (and the CPU tests stay fast)."""
        if self.warmup == "auto":
            return device_type == "cuda"
        return self.warmup == "on"

    def warmup_layer_ids(self) -> tuple[int, ...] | None:
        """--warmup-feature-layers as layer ids in the given order (() = none); None = auto, resolved once the model is
        known (verifier_svc.warmup.feature_layers)."""
        text = self.warmup_feature_layers.strip().lower()
        if text in ("auto", ""):
            return None
        if text == "none":
            return ()
        try:
            ids = tuple(int(p) for p in text.replace(" ", "").split(","))
        except ValueError:
            ids = ()
        if not ids or min(ids) < 0:
            raise ConfigError(f"--warmup-feature-layers {self.warmup_feature_layers!r}: auto, none or layer ids such as 1,3,5")
        return ids

    def validate(self) -> None:
        self.validate_server()
        if self.model and not (pathlib.Path(self.model) / "config.json").exists():
            raise ConfigError(f"--model {self.model!r}: no config.json there; point it at a checkpoint directory")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype {self.dtype!r}: choose auto, float32, bfloat16 or float16")
        if self.kernels not in ("auto", "on", "off"):
            raise ConfigError(f"--kernels {self.kernels!r}: choose auto, on or off")
        if self.paged_kv not in ("auto", "on", "off"):
            raise ConfigError(f"--paged-kv {self.paged_kv!r}: choose auto, on or off")
        if self.kv_cache_gb < 0:
            raise ConfigError(f"--kv-cache-gb {self.kv_cache_gb}: must be >= 0 (0 = automatic)")
        if self.experts not in ("native", "mxfp4"):
            raise ConfigError(f"--experts {self.experts!r}: choose native or mxfp4")
        if self.experts == "mxfp4" and self.kernels == "off" and self.expert_cache_gb <= 0:
            raise ConfigError("--experts mxfp4 (resident) runs on the kernels: drop --kernels off")
        if self.expert_cache_gb < 0:
            raise ConfigError(f"--expert-cache-gb {self.expert_cache_gb}: must be >= 0 (0 = every expert resident)")
        parts = {p.strip() for p in self.expert_prefetch.split(",") if p.strip()}
        if not parts or not (parts <= {"union", "layer"} or parts == {"none"}):
            raise ConfigError(f"--expert-prefetch {self.expert_prefetch!r}: union, layer, union,layer or none")
        if self.expert_cache_mode not in ("device", "host"):
            raise ConfigError(f"--expert-cache-mode {self.expert_cache_mode!r}: choose device or host")
        if self.expert_eviction not in ("lru", "cyclic"):
            raise ConfigError(f"--expert-eviction {self.expert_eviction!r}: choose lru or cyclic")
        if self.expert_eviction != "lru" and self.expert_cache_mode == "device":
            raise ConfigError(f"--expert-eviction {self.expert_eviction} is a policy of --expert-cache-mode host (the device-managed cache evicts LRU within each layer's slots)")
        if not 0 <= self.expert_arrival_share <= 1:
            raise ConfigError(f"--expert-arrival-share {self.expert_arrival_share}: must be in [0, 1] (a share of the cache's slots; 0 = off)")
        if self.expert_guess_width < 0:
            raise ConfigError(f"--expert-guess-width {self.expert_guess_width}: must be >= 0 (0 = auto: a quarter of the router's top_k)")
        if self.expert_cache_gb > 0 and self.experts != "mxfp4":
            raise ConfigError("--expert-cache-gb serves offloaded MXFP4 experts: add --experts mxfp4")
        if self.warmup not in ("auto", "on", "off"):
            raise ConfigError(f"--warmup {self.warmup!r}: choose auto, on or off")
        self.warmup_layer_ids()
        if self.inline_verify not in ("auto", "on", "off"):
            raise ConfigError(f"--inline-verify {self.inline_verify!r}: choose auto, on or off")
        if self.torch_threads < 0:
            raise ConfigError(f"--torch-threads {self.torch_threads}: must be >= 0 (0 = torch's default)")
        if self.prefill_chunk < 0:
            raise ConfigError(f"--prefill-chunk {self.prefill_chunk}: must be >= 0 (0 = the whole prompt in one forward)")
        if self.prefill_threads < 0:
            raise ConfigError(f"--prefill-threads {self.prefill_threads}: must be >= 0 (0 = as --torch-threads)")
        for name in ("max_sessions", "max_block_size", "max_tokens_limit", "max_pending"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.max_wave_sessions <= 1024:
            raise ConfigError(f"--max-wave-sessions {self.max_wave_sessions}: a session count 1..1024, or 0 = auto")
        if self.session_ttl_s <= 0:
            raise ConfigError("--session-ttl-s must be > 0")
