"""Where a decode step's time goes: host wall time per step, GPU kernel time per step, top kernels.

python scripts/profile_decode.py [preset] [batch] [context]   (GPU; random weights)
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.sampling_params import SamplingParams


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    context = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    engine = LLMEngine(EngineConfig(model=preset, load_format="dummy", max_model_len=context + 64,
                                    max_num_seqs=batch, max_num_batched_tokens=max(8192, context + 1)))
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 1000 + 1 for j in range(context)], params)
    while engine.stats.num_waiting or engine.stats.last_step_prefill or not engine.stats.num_steps:
        engine.step()
    for _ in range(5):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(20):
        engine.step()
    wall = (time.perf_counter() - t0) / 20
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / 5
    print(f"{preset} batch={batch} context={context}: host wall {wall * 1e3:.2f} ms/step, "
          f"GPU kernels {gpu_us / 1e3:.2f} ms/step, graphs={engine.runner.graphs is not None}")
    print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
