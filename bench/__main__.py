import sys

if "--gpu" in sys.argv[1:]:  # the GPU check (bench/gpu.py): its own options; no allocator pinning (CPU timing only)
    from .gpu import main as gpu_main

    gpu_main([a for a in sys.argv[1:] if a != "--gpu"])
else:
    from .run import main, pin_allocator

    pin_allocator(sys.argv[1:])
    main()
