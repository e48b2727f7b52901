"""`python -m benchmarks`: run every benchmark in turn."""

from benchmarks import (
    cache_admission,
    cascade,
    cuda_graphs,
    engine_overhead,
    host_tier,
    itl_target,
    lora,
    planner_vs_torch,
    quantization,
    sim_vs_real,
    speculation,
    structured_output,
    torch_vs_llama,
    window_kv,
)

if __name__ == "__main__":
    engine_overhead.main()
    print()
    torch_vs_llama.main()
    print()
    quantization.main()
    print()
    host_tier.main()
    print()
    speculation.main()
    print()
    cache_admission.main()
    print()
    itl_target.main()
    print()
    planner_vs_torch.main()
    print()
    structured_output.main()
    print()
    window_kv.main()
    print()
    sim_vs_real.main()
    print()
    cascade.main()
    print()
    lora.main()
    print()
    cuda_graphs.main()
