"""Every MindSpeed-LLM FSDP2 YAML copied under tests/data/mindspeed_fsdp2 (f88dd26d, head = master c77308a1,
head_newer_ids, v26.1.0 = the release) validates at its launcher's world size, with its launcher's arguments and
only the paths replaced (model → a directory holding the model's config.json, data → a parquet file, output →
tmp).

The launcher: the entry of `launchers.json` (the shared copy of the `.sh` launchers of f88dd26d, master and v26.1.0)
whose YAML is the file (head's and the release's unchanged files are f88dd26d's copies, byte for byte); for the
newer ids' YAMLs, which launchers.json lacks, the `.sh` beside them in MindSpeed-LLM c77308a1 (NEWER_ID_LAUNCHERS,
world and arguments as those scripts give them). A YAML no launcher runs (upstream's launcher names another
file) validates at the world its own `parallel.fsdp_size` names (MindSpeed's fsdp_size is the world size), else
2. The DeepSeek-V4 example's launcher turns on expert parallel 128 under the YAML's `ep_dispatcher: mc2` (Ascend's
MC2 kernels): that one is declined, with that reason and no other (DECLINED). Validation is the entry point's own
(`parse_command_line`, what `--dry-run` prints), in process: cheap (~0.1 s a file). The qwen3 / qwen3_moe YAMLs a
launcher runs go through `--dry-run` in test_mindspeed_yaml.py (the real models' config.json); the others here (the
qwen3 ones with the same config.json).

The config.json: the published model's sizes that the layout rules read (heads, key/value heads, experts,
layers, vocabulary). transformers' own config classes default to the reference checkpoint of their family
(MiniMax-M2, Qwen3-Next-80B-A3B, GLM-5 (MindSpeed's mcore 744b script gives the same 256 experts, 64 heads,
hidden 6144), DeepSeek-V4-Flash); gpt-oss-20b's 24 layers and 32 experts (transformers' defaults are
gpt-oss-120b's) and Step-3.5-Flash's sizes (test_step35_training.STEP35_FLASH) are written from the hub's
config.json. LongCat-Flash-Lite's config.json is held by no library here: transformers' LongCat-Flash defaults
(LongCat-Flash-Chat: 512 experts, 64 heads) stand in for it. Mamba-3 (no experts, no heads split): the tiny
MindSpeed-layout directory of test_mamba3_training.
"""
import json
from pathlib import Path

import pytest
import yaml

from tests.support.mindspeed_yaml import FALLBACK, PATH_FIELDS, in_scope, real_model_name, with_paths
from tests.support.launchers import REPO

DATA = Path(REPO) / "tests" / "data" / "mindspeed_fsdp2"
FOLDERS = ("f88dd26d", "head", "head_newer_ids", "v26.1.0")
# The newer ids' launchers in MindSpeed-LLM c77308a1 (NPUS_PER_NODE x NNODES; their --group.field arguments).
NEWER_ID_LAUNCHERS = {
    "examples__fsdp2__deepseek4__pretrain_deepseek4_flash_284b_4k_fsdp2_A3.yaml": (256, [  # 16 x 16
        "--parallel.fsdp_size", "256", "--parallel.ep_size", "128", "--parallel.ep_fsdp_size", "2",
        "--training.per_device_train_batch_size", "2", "--training.gradient_accumulation_steps", "4"]),
    "examples__fsdp2__longcat_flash_lite__pretrain_longcat_flash_lite_4k_fsdp2_A3.yaml": (32, [
        "--parallel.fsdp_size", "32", "--parallel.ep_size", "32", "--training.per_device_train_batch_size", "1",
        "--training.gradient_accumulation_steps", "1"]),
    "tests__pipeline__st__deepseek4-flash__pretrain_deepseek4_flash_1k_fsdp2.yaml": (8, []),
    "tests__pipeline__st__glm52__pretrain_glm52_38b_4k_fsdp2_A3.yaml": (8, [
        "--parallel.fsdp_size", "8", "--parallel.ep_size", "8", "--parallel.ep_fsdp_size", "1",
        "--training.per_device_train_batch_size", "1", "--training.gradient_accumulation_steps", "1",
        "--optimization.indexer_loss_coeff", "0.1"]),
    "tests__pipeline__st__longcat-flash-lite__pretrain_longcat_flash_lite_4k_fsdp2.yaml": (8, [
        "--parallel.fsdp_size", "8", "--parallel.ep_size", "8", "--training.per_device_train_batch_size", "1",
        "--training.gradient_accumulation_steps", "1"]),
    "tests__st__shell_scripts__pretrain_deepseek4_flash_1k_fsdp2_cp2.yaml": (8, []),
}


def _launcher_table():
    """{(folder, file name): (world, args)} from launchers.json (the first launcher that runs the file)."""
    table = {}
    for commit, launchers in json.loads((DATA / "launchers.json").read_text()).items():
        for _, entry in sorted(launchers.items()):
            name = entry["yaml"][2:] if entry["yaml"].startswith("./") else entry["yaml"]
            name = name.replace("/", "__")
            folder = next((f for f in FALLBACK[commit] if (DATA / f / name).is_file()), None)
            if folder is not None:
                table.setdefault((folder, name), (entry["world"], list(entry["args"])))
    table.update({("head_newer_ids", name): launcher for name, launcher in NEWER_ID_LAUNCHERS.items()})
    return table


LAUNCHERS = _launcher_table()
DECLINED = {("head_newer_ids", "examples__fsdp2__deepseek4__pretrain_deepseek4_flash_284b_4k_fsdp2_A3.yaml"):
            "parallel.ep_dispatcher: mc2 needs Ascend NPUs (torch_npu MC2 kernels) — use eager or fused"}
EVERY = [(folder, p.name) for folder in FOLDERS for p in sorted((DATA / folder).glob("*.yaml"))]
# the qwen3 / qwen3_moe ones a launcher runs: test_mindspeed_yaml.py (through --dry-run); the rest here
HERE = [case for case in EVERY if not in_scope(case[1]) or case not in LAUNCHERS]


def _family(name: str) -> str:
    if in_scope(name):
        return "qwen3"
    for key, family in (("gpt_oss", "gpt_oss"), ("mamba3", "mamba3"), ("minimax", "minimax_m27"),
                        ("qwen3_next", "qwen3_next"), ("qwen3-next", "qwen3_next"), ("step", "step35"),
                        ("glm52", "glm52"), ("longcat", "longcat_flash_ngram"), ("deepseek4", "deepseek_v4")):
        if key in name:
            return family
    raise AssertionError(f"no family known for {name}")


def _sized_config(family: str) -> dict:
    """The config.json of the model a family's YAMLs are written for (see the module docstring)."""
    import transformers

    if family.startswith("Qwen3"):  # the published config.json test_mindspeed_yaml.py's dry runs use
        from tests.support.mindspeed_yaml import REAL_MODELS

        return REAL_MODELS[family]
    if family == "step35":
        from tests.support.step35_yaml import STEP35_FLASH
        from tests.support.step35_reference import step35_config_dict

        return step35_config_dict(**STEP35_FLASH)
    if family == "longcat_flash_ngram":
        from fsdp2_backend.models.longcat_flash_ngram.modeling import LongcatFlashNgramConfig

        return LongcatFlashNgramConfig().to_dict()
    classes = {"gpt_oss": ("GptOssConfig", dict(num_hidden_layers=24, num_local_experts=32,
                                                layer_types=["sliding_attention", "full_attention"] * 12)),
               "minimax_m27": ("MiniMaxM2Config", {}), "qwen3_next": ("Qwen3NextConfig", {}),
               "glm52": ("GlmMoeDsaConfig", {}), "deepseek_v4": ("DeepseekV4Config", {})}
    name, overrides = classes[family]
    return getattr(transformers, name)(**overrides).to_dict()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("every_yaml")
    parquet = root / "train-00000-of-00001.parquet"
    pq.write_table(pa.table({"text": ["one document", "another document"]}), str(parquet))
    built = {}

    def model(family):
        if family not in built:
            path = root / family
            if family == "mamba3":
                from tests.support.tiny_models import mamba3_mindspeed_dir

                mamba3_mindspeed_dir(path)
            else:
                path.mkdir()
                (path / "config.json").write_text(json.dumps(_sized_config(family), default=str))
            built[family] = str(path)
        return built[family]
    return {"model": model, "parquet": str(parquet)}


def test_every_copied_yaml_is_validated_here_or_in_test_mindspeed_yaml():
    from tests.support.mindspeed_yaml import MAPPED

    there = {(path.parent.name, path.name) for _, _, _, path in MAPPED}
    unlaunched = sorted(case for case in EVERY if case not in LAUNCHERS)
    assert set(EVERY) == set(HERE) | there, set(EVERY) - set(HERE) - there
    assert len(EVERY) == 64
    # upstream's own gaps: launchers that name a file no commit has, and the GLM-5.2 example (a chat launcher only)
    assert unlaunched == [
        ("f88dd26d", "examples__fsdp2__step35__pretrain_step_3p5_flash_196b_4K_fsdp2_A3.yaml"),
        ("head", "examples__fsdp2__qwen3__pretrain_qwen3_1point7b_4k_fsdp2_A2.yaml"),
        ("head", "examples__fsdp2__qwen3__tune_qwen3_1point7b_4k_fsdp2_A2.yaml"),
        ("head_newer_ids", "examples__fsdp2__glm52__glm52_744b_4k_fsdp2_A3.yaml"),
        ("v26.1.0", "examples__fsdp2__glm52__glm52_744b_4k_fsdp2_A3.yaml"),
        ("v26.1.0", "examples__fsdp2__step35__pretrain_step_3p5_flash_196b_4K_fsdp2_A3.yaml")], unlaunched


@pytest.mark.parametrize("folder,name", HERE, ids=[f"{folder}:{name[:-5]}" for folder, name in HERE])
def test_yaml_validates_at_its_launchers_world_size(assets, tmp_path, folder, name):
    from fsdp2_backend.launch import parse_command_line

    yaml_file = DATA / folder / name
    own_world = (yaml.safe_load(yaml_file.read_text())["parallel"] or {}).get("fsdp_size", 2)
    world, args = LAUNCHERS.get((folder, name), (own_world, []))
    family = _family(name)
    model = assets["model"](real_model_name(name) if family == "qwen3" else family)
    dataset = json.dumps({"file_name": assets["parquet"]})
    paths = (model, model, dataset, str(tmp_path / "output"))
    args = with_paths(yaml_file, args, paths)
    given = set(args[::1])
    for (group, field), value in zip(PATH_FIELDS, paths):  # the fields neither the YAML nor the launcher gives
        if f"--{group}.{field}" not in given:
            args += [f"--{group}.{field}", value]
    if (folder, name) in DECLINED:
        from fsdp2_backend.usage_errors import UsageError

        with pytest.raises(UsageError) as err:
            parse_command_line([str(yaml_file), *args], world)
        assert str(err.value) == DECLINED[(folder, name)], str(err.value)
        return
    config, lines = parse_command_line([str(yaml_file), *args], world)
    assert config.model.model_name_or_path == model and config.training.output_dir == str(tmp_path / "output")
    in_yaml = yaml.safe_load(yaml_file.read_text())["parallel"]
    if "--parallel.ep_size" in args:
        assert config.parallel.ep_size == int(args[args.index("--parallel.ep_size") + 1])
    elif "ep_size" in in_yaml:
        assert config.parallel.ep_size == in_yaml["ep_size"]
