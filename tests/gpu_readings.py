"""NVML readings of real cards, in the shape app/fleet/nvml.py reads them, shared by the tests that replay them."""

# An A100 40GB in MIG mode with two 3g.20gb instances, as NVML reads it (card, then each instance's handle).
MIG_CARD = {"nvml_index": 0, "name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-5c4c7d1e-1111-2222-3333-444444444444",
            "compute_capability": "8.0", "memory_total": 42_949_672_960, "memory_used": 1_300_234_240,
            "memory_free": 41_649_438_720, "utilization_gpu": None,
            "mig": [{"mig_index": 0, "name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                     "uuid": "MIG-0e6f2e6a-aaaa-5c5b-9d8e-111111111111", "memory_total": 20_937_965_568,
                     "memory_used": 13_631_488, "memory_free": 20_924_334_080},
                    {"mig_index": 1, "name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb",
                     "uuid": "MIG-7f3a9b2c-bbbb-5d6e-8f90-222222222222", "memory_total": 20_937_965_568,
                     "memory_used": 4_307_550_208, "memory_free": 16_630_415_360}]}
