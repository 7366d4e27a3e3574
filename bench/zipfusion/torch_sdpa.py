#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on the decode shapes of zipfusion_gpu_bench, as a peer.

One query token per sequence, 32 query heads over 8 KV heads (enable_gqa), head_dim 128, bf16,
batch and context as the harness's. Times each backend that runs (cuDNN, flash) as the harness
times its kernels: median of --iters runs, each after writing a buffer larger than L2 so that K
and V come from memory, timed with CUDA events around the call alone. Prints lines
"<name> <context> <batch> <microseconds>" for zipfusion_gpu_bench --peer; nothing for a backend
that refuses a shape. Exits 3 when torch or a CUDA device is missing.

  torch_sdpa.py [--quick] [--iters N] [--contexts 1024,4096,...] [--batches 1,8]
"""
import argparse
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--iters', type=int, default=15)
    ap.add_argument('--contexts', default='1024,4096,8192,32768,131072')
    ap.add_argument('--batches', default='1,8')
    args, _unknown = ap.parse_known_args()  # the harness's other flags are not ours
    contexts = [int(x) for x in args.contexts.split(',')]
    batches = [int(x) for x in args.batches.split(',')]
    iters = args.iters
    if args.quick:
        contexts, iters = [1024, 8192, 32768], 5
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f'torch_sdpa.py: {e}', file=sys.stderr)
        return 3
    if not torch.cuda.is_available():
        print('torch_sdpa.py: no CUDA device', file=sys.stderr)
        return 3
    dev = torch.device('cuda')
    l2 = getattr(torch.cuda.get_device_properties(dev), 'L2_cache_size', 64 << 20)
    flush = torch.empty(max(256 << 20, 4 * l2), dtype=torch.uint8, device=dev)
    backends = [('torch_cudnn', SDPBackend.CUDNN_ATTENTION), ('torch_flash', SDPBackend.FLASH_ATTENTION)]
    print(f'# torch {torch.__version__}, {torch.cuda.get_device_name(dev)}')
    gen = torch.Generator(device=dev).manual_seed(1)
    for ctx in contexts:
        for batch in batches:
            q = torch.randn(batch, 32, 1, 128, device=dev, dtype=torch.bfloat16, generator=gen)
            k = torch.randn(batch, 8, ctx, 128, device=dev, dtype=torch.bfloat16, generator=gen)
            v = torch.randn(batch, 8, ctx, 128, device=dev, dtype=torch.bfloat16, generator=gen)
            for name, backend in backends:
                try:
                    with sdpa_kernel(backend):
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # warm-up, and may refuse
                        times = []
                        for _ in range(iters):
                            flush.fill_(1)
                            start = torch.cuda.Event(enable_timing=True)
                            stop = torch.cuda.Event(enable_timing=True)
                            start.record()
                            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                            stop.record()
                            stop.synchronize()
                            times.append(start.elapsed_time(stop) * 1000.0)
                except RuntimeError as e:  # backend not available for this shape or build
                    print(f'# {name} {ctx} {batch}: {str(e).splitlines()[0][:120]}')
                    continue
                times.sort()
                print(f'{name} {ctx} {batch} {times[len(times) // 2]:.2f}', flush=True)
            del q, k, v
    return 0


if __name__ == '__main__':
    sys.exit(main())
