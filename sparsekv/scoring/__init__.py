"""The learned scorer: the gating head (`head`), the adapter that carries it to a model (`adapter`:
load, save, push, attach), its files and checks (`files`), its model card (`card`) and the
optional LoRA of the base model (`lora`)."""
