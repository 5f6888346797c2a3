"""The config's rules, grouped by what they check: one module per config group (`model`, `data`, `parallel`,
`optimization`, `training`), and the rules that span groups (`run_inputs`: values no run can use and
contradictory fields; `input_files`: the files a run reads; `mindspeed_master_fields`: the fields of MindSpeed-LLM
master's YAMLs). `fsdp2_backend.config.validation` calls each once, before any process group; all are torch-free.
"""
