"""Reading a Megatron-LM / MindSpeed-LLM command line: the argparse parser of every flag and the shell words."""
