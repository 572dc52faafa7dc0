"""The bad-input sweep (`python eval/sweep_bad_inputs.py`): its machinery (`framework`) and one
module of cases per surface (`api`, `adapter_files`, `train_config`, `eval_cli`)."""
