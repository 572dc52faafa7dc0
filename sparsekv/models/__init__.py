"""The models sparsekv runs on: family specifics (`families`), one loader (`loading`), the offline
default model (`default`) and tiny random models for tests (`tiny`)."""
