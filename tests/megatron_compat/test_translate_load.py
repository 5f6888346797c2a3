"""How the front end reads --load: an HF directory is the model; a checkpoint (save) directory is resumed or, while
it holds none, the run starts from scratch — and then only a script that gives the model's shape must give all of
it (the checkpoint otherwise describes its model)."""
from megatron_compat.translate import translate_megatron
from tests.support.megatron_lines import TRANSLATE_BASE_FLAGS


def test_load_of_a_checkpoint_directory_needs_no_architecture_flags(tmp_path):
    """`--load X --save X`: X resumes (or starts fresh while empty); without architecture flags the checkpoint
    defines the model, so no flag is demanded and no architecture is invented from Megatron's defaults."""
    arch_flags = {"--num-layers", "--hidden-size", "--num-attention-heads", "--max-position-embeddings"}
    arch_free = [a for i, a in enumerate(TRANSLATE_BASE_FLAGS) if a not in arch_flags and TRANSLATE_BASE_FLAGS[i - 1] not in arch_flags]
    ckpt = str(tmp_path / "ckpt")
    fields = translate_megatron(arch_free + ["--load", ckpt, "--save", ckpt]).fields
    assert fields["training"]["resume_from_checkpoint"] == ckpt and fields["training"]["output_dir"] == ckpt
    arch = fields["model"].get("architecture", {})
    assert "model_type" not in arch and "num_hidden_layers" not in arch and "model_name_or_path" not in fields["model"]
    with_flags = translate_megatron(TRANSLATE_BASE_FLAGS + ["--load", ckpt, "--use-checkpoint-args"]).fields
    assert "model_type" not in with_flags["model"].get("architecture", {})  # --use-checkpoint-args: the checkpoint's
