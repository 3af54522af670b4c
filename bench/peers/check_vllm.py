"""`make bench-peers` ends with this: vLLM and the torch beside it import and say their versions."""

if __name__ == "__main__":
    import torch
    import transformers
    import vllm

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}: import ok")
