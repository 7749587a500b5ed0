"""Static checks of the image recipes: what CI cannot build (GPU bases, MS-AMP, LUMI) is at least
consistent with its pins, lint-clean, parseable and wired to step scripts that exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_ds.image_flavours import FLAVOURS

from .recipes import (
    DEFINITIONS,
    DOCKERFILES,
    NOT_PINS,
    ROOT,
    STEP_SCRIPTS,
    definition_arguments,
    definition_sections,
    dockerfile_args,
    dockerfile_instructions,
    read_pins,
)

MAKE_TARGETS = (*(flavour.make for flavour in FLAVOURS.values()), "sif", "sif-cpu", "sif-lumi", "sqsh")


@pytest.mark.parametrize("recipe", sorted(DOCKERFILES))
def test_every_dockerfile_pin_comes_from_the_pin_file(recipe):
    pins, args = read_pins(DOCKERFILES[recipe]), dockerfile_args(recipe)
    unpinned = sorted(name for name in args if name not in pins and name not in NOT_PINS)
    assert not unpinned, f"{recipe}: ARG {unpinned} not listed in {DOCKERFILES[recipe]}"
    differ = {name: (args[name], pins[name]) for name in args if name in pins and args[name] != pins[name]}
    assert not differ, f"{recipe}: ARG default != {DOCKERFILES[recipe]} (default, pin): {differ}"


@pytest.mark.parametrize("recipe", sorted(DOCKERFILES))
def test_dockerfile_lint(recipe):
    steps = dockerfile_instructions(recipe)
    text = (ROOT / recipe).read_text()
    assert steps[0][0] == "ARG" and steps[1][0] == "FROM", f"{recipe}: must start with the base ARG, then FROM"
    base_arg = steps[0][1].split("=")[0]
    assert steps[1][1] == "${%s}" % base_arg, f"{recipe}: FROM must use the {base_arg} build argument"
    assert ":latest" not in text, f"{recipe}: a ':latest' tag is not a pin"
    assert re.search(r":[\w.-]+$", steps[0][1]), f"{recipe}: base image has no pinned tag: {steps[0][1]}"
    for instruction, rest in steps:
        if instruction in ("COPY", "ADD"):
            assert instruction == "COPY", f"{recipe}: use COPY, not ADD ({rest})"
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"{recipe}: COPY {source}: no such path in the repository"
        if instruction == "RUN":
            assert "|| true" not in rest, f"{recipe}: '|| true' hides a failing step: {rest}"
            for script in re.findall(r"/opt/mds/steps/([\w.-]+)", rest):
                assert (ROOT / "docker" / "steps" / script).is_file(), f"{recipe}: step {script} does not exist"
            if re.search(r"pip_install|install-[\w-]+\.sh", rest):
                assert "--mount=type=secret,id=pip_ca" in rest, f"{recipe}: pip step without the pip_ca secret: {rest}"
    labels = " ".join(rest for instruction, rest in steps if instruction == "LABEL")
    for key in ("org.opencontainers.image.version", "org.opencontainers.image.source",
                "org.opencontainers.image.revision", "org.opencontainers.image.base.name",
                "io.mds.stack.torch.pinned", "io.mds.stack.deepspeed.pinned", "io.mds.stack.record"):
        assert key + "=" in labels, f"{recipe}: LABEL {key} missing"
    # a version label is the pin asked for, never stated as what the image holds (stack.json records that)
    stack_keys = re.findall(r"(io\.mds\.stack\.[\w.-]+)=", labels)
    assert all(key.endswith(".pinned") for key in stack_keys if key != "io.mds.stack.record"), \
        f"{recipe}: stack labels must say they are pins (io.mds.stack.NAME.pinned): {stack_keys}"
    runs = [rest for instruction, rest in steps if instruction == "RUN"]
    assert runs[0].endswith("check-base.sh"), f"{recipe}: the first RUN must be the base preflight"
    assert runs[-1].endswith("self-check.sh"), f"{recipe}: the last RUN must be the self check"
    # cache-friendly: our source is copied after every dependency install
    source = next(i for i, (ins, rest) in enumerate(steps) if ins == "COPY" and rest.startswith("megatron_ds/ "))
    assert not any(re.search(r"install-(deepspeed|deps|gpu-extension|msamp)", rest)
                   for ins, rest in steps[source:]), f"{recipe}: a dependency is installed after COPY megatron_ds/"


# What an image build reads from the repository: anything else (README, bench/, tests/) in a COPY would
# rebuild the install and self-check layers on every edit of a document or a benchmark log.
INSTALL_INPUTS = {"pyproject.toml", "entrypoint.py", "megatron_ds", "cuda", "rocm", "patches", "docker"}


def copy_sources(recipe) -> list[str]:
    sources = []
    for instruction, rest in dockerfile_instructions(recipe):
        if instruction == "COPY":
            sources += [word for word in rest.split()[:-1] if not word.startswith("--")]
    return sources


@pytest.mark.parametrize("recipe", sorted(DOCKERFILES))
def test_no_whole_context_copy(recipe):
    for source in copy_sources(recipe):
        top = source.strip("/").split("/")[0]
        assert top not in ("", ".", "..", "*") and "*" not in top, \
            f"{recipe}: COPY {source} copies the whole build context: copy only what the install needs"
        assert top in INSTALL_INPUTS, f"{recipe}: COPY {source}: not an install input ({sorted(INSTALL_INPUTS)})"


@pytest.mark.parametrize("definition", sorted(DEFINITIONS))
def test_no_whole_tree_in_apptainer_files(definition):
    for line in definition_sections(definition)["files"].splitlines():
        source = line.split()[0].strip("/")
        assert source not in ("", ".", "*") and source.split("/")[0] in INSTALL_INPUTS, \
            f"{definition}: %files {line.strip()}: copy only what the install needs"


def step_needs(script: str) -> set[str]:
    """A step script and the scripts it sources or runs ($(dirname "$0")/NAME), transitively."""
    needed, todo = set(), [script]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        todo += re.findall(r'\$\(dirname "\$0"\)/([\w.-]+)', (ROOT / "docker" / "steps" / name).read_text())
    return needed


@pytest.mark.parametrize("recipe", sorted(DOCKERFILES))
def test_step_scripts_are_copied_before_the_step_that_runs_them(recipe):
    """Each RUN's step scripts (and what they source or call) are in the image by then: the recipes copy
    each script just before its first use, so editing a late step does not rebuild the early ones."""
    copied: set[str] = set()
    for instruction, rest in dockerfile_instructions(recipe):
        words = rest.split()
        if instruction == "COPY" and words[-1].rstrip("/") == "/opt/mds/steps":
            for source in words[:-1]:
                path = ROOT / source
                copied |= {p.name for p in path.iterdir()} if path.is_dir() else {path.name}
        if instruction == "RUN":
            for script in re.findall(r"/opt/mds/steps/([\w.-]+)", rest):
                missing = step_needs(script) - copied
                assert not missing, f"{recipe}: RUN uses {script} before COPY of {sorted(missing)}: {rest[:80]}"


def test_recipes_share_their_step_scripts():
    used = {script for recipe in DOCKERFILES for script in re.findall(r"/opt/mds/steps/([\w.-]+)",
                                                                       (ROOT / recipe).read_text())}
    used |= set(re.findall(r"/opt/mds/steps/([\w.-]+)", (ROOT / "apptainer/lumi.def").read_text()))
    used |= {"lib.sh", "fetch-source.sh"}  # sourced / called by other steps (record_stack.py is not *.sh)
    assert {p.name for p in STEP_SCRIPTS} == used, "every step script is used by a recipe, and only existing ones are"


def test_shellcheck_step_scripts():
    if not shutil.which("shellcheck"):
        pytest.fail("shellcheck not found: install it (`make test` does, as root: apt-get install shellcheck)")
    scripts = [*STEP_SCRIPTS, ROOT / "docker/cpu-base/build.sh"]
    result = subprocess.run(["shellcheck", "--shell=sh", "--external-sources", *map(str, scripts)],
                            cwd=ROOT / "docker" / "steps", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_step_hides_a_failure():
    for path in [*STEP_SCRIPTS, ROOT / "docker/cpu-base/build.sh", ROOT / "patches/apply"]:
        assert "|| true" not in path.read_text(), f"{path}: '|| true' hides a failure"
        if path.suffix == ".sh" and path.name != "lib.sh":
            assert '. "$(dirname "$0")/lib.sh"' in path.read_text() or path.parent.name == "cpu-base", \
                f"{path}: does not source lib.sh (strict mode, logging, pip CA)"


@pytest.mark.parametrize("definition", sorted(DEFINITIONS))
def test_apptainer_definition(definition, tmp_path):
    from spython.main.parse.parsers import SingularityParser

    sections = definition_sections(definition)
    for name in ("help", "labels", "files", "environment", "runscript", "test", "arguments"):
        assert sections.get(name, "").strip(), f"{definition}: %{name} missing or empty"
    header = dict(line.split(":", 1) for line in sections["header"].splitlines() if ":" in line)
    bootstrap = header["Bootstrap"].strip()
    assert bootstrap == {"apptainer/mds.def": "docker-daemon", "apptainer/lumi.def": "localimage"}[definition]
    # spython parses docker-type bootstraps only: parse a copy whose header says docker (sections unchanged)
    text = (ROOT / definition).read_text()
    copy = tmp_path / "recipe.def"
    copy.write_text(text.replace(f"Bootstrap: {bootstrap}", "Bootstrap: docker", 1))
    recipe = SingularityParser(str(copy)).recipe["spython-base"]
    runscript = recipe.cmd if "exec entrypoint" in recipe.cmd else "\n".join(recipe.install)  # multi-line: a script
    assert 'exec entrypoint "$@"' in runscript, f"{definition}: %runscript must exec entrypoint \"$@\""
    assert sections["runscript"].strip().splitlines()[-1].strip() == 'exec entrypoint "$@"'
    assert any("self-check.sh" in line for line in recipe.install), f"{definition}: %test must run the self check"
    if bootstrap == "docker-daemon":  # the image's labels (its flavour) carry over: tests/images/test_sif.py
        assert not any(label.startswith("io.mds.flavour ") for label in recipe.labels), \
            f"{definition}: the flavour is the Docker image's; a label here would be ignored"
    else:
        assert any(label.startswith("io.mds.flavour ") for label in recipe.labels)
    stack_labels = [label.split()[0] for label in recipe.labels if label.startswith("io.mds.stack.")]
    assert all(key.endswith(".pinned") for key in stack_labels), f"{definition}: stack labels must say they are pins"
    for entry in recipe.files:
        source = entry.split()[0]
        assert (ROOT / source).exists(), f"{definition}: %files {source}: no such path (build from the repo root)"
    # every {{ VAR }} is declared in %arguments, and the defaults equal the platform's pin file
    arguments = definition_arguments(definition)
    used = set(re.findall(r"{{\s*(\w+)\s*}}", text))
    assert used <= set(arguments), f"{definition}: undeclared arguments {used - set(arguments)}"
    if DEFINITIONS[definition]:
        pins = read_pins(DEFINITIONS[definition])
        differ = {k: (v, pins.get(k)) for k, v in arguments.items() if pins.get(k) != v}
        assert not differ, f"{definition}: %arguments default != {DEFINITIONS[definition]}: {differ}"


def test_makefile_targets_print_the_pinned_builds():
    env = dict(os.environ, DOCKER="docker", APPTAINER="apptainer", PIP_CA="")
    out = subprocess.run(["make", "-n", *MAKE_TARGETS], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for name, value in read_pins("cuda/versions").items():
        assert f"--build-arg '{name}={value}'" in text
    assert "-f docker/rocm.Dockerfile" in text and "--build-arg 'ROCM_VERSION=" in text
    assert "-f docker/msamp.Dockerfile" in text
    assert "apptainer build --build-arg IMAGE=mds:latest mds.sif apptainer/mds.def" in text
    assert "apptainer build --build-arg IMAGE=mds:cpu mds-cpu.sif apptainer/mds.def" in text
    # lumi.def's arguments, and only those, from rocm/versions (apptainer refuses unused ones)
    keys = "|".join(definition_arguments("apptainer/lumi.def"))
    assert f"grep -E '^({keys})=' rocm/versions > .cache/sif-lumi.args" in text
    assert "apptainer build --build-arg-file .cache/sif-lumi.args mds-lumi.sif apptainer/lumi.def" in text
    assert "enroot import -o mds.sqsh dockerd://mds:latest" in text
    based = subprocess.run(["make", "-n", "image", "BASE_IMAGE=example/base:1"], cwd=ROOT, env=env,
                           capture_output=True, text=True).stdout
    assert based.rindex("'BASE_IMAGE=example/base:1'") > based.index("'BASE_IMAGE=nvcr.io"), \
        "BASE_IMAGE=... must come after the pinned one (the last --build-arg wins)"


@pytest.mark.parametrize("name", sorted(FLAVOURS))
def test_each_flavours_make_target_builds_its_recipe_with_its_pins(name):
    """megatron_ds/image_flavours.json is the one list of flavours: its make target builds its recipe with its pin
    file's build arguments, and the image it makes says it is that flavour (doctor's default requirements)."""
    flavour = FLAVOURS[name]
    env = dict(os.environ, DOCKER="docker", PIP_CA="", BASE_IMAGE="")
    out = subprocess.run(["make", "-n", flavour.make], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    build = next((line for line in out.stdout.splitlines() if f" -f {flavour.recipe} " in line), None)
    assert build, f"make {flavour.make} does not build {flavour.recipe}:\n{out.stdout}"
    for key, value in read_pins(flavour.pins).items():
        assert f"--build-arg '{key}={value}'" in build, f"make {flavour.make}: {key} from {flavour.pins} not passed"
    assert flavour.base_arg in dockerfile_args(flavour.recipe), f"{flavour.recipe}: no ARG {flavour.base_arg}"
    passed = re.findall(r"--build-arg MDS_IMAGE_FLAVOUR=(\w+)", build)
    env_default = re.findall(r"MDS_IMAGE_FLAVOUR=(\w+)", " ".join(
        rest for instruction, rest in dockerfile_instructions(flavour.recipe) if instruction == "ENV"))
    made = passed[-1] if passed else dockerfile_args(flavour.recipe).get("MDS_IMAGE_FLAVOUR") or env_default[0]
    assert made == name, f"make {flavour.make} builds an image of flavour {made!r}, not {name!r}"


# The source label once named a repository address nobody had made: the label says where the tree came from
# (the git remote the Makefile reads), and a recipe built without make says `local`, never a guessed URL.
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+|[\w.-]+@[\w.-]+:\S+", re.I)


@pytest.mark.parametrize("recipe", [*sorted(DOCKERFILES), *sorted(DEFINITIONS)])
def test_source_label_defaults_to_local(recipe):
    if recipe in DOCKERFILES:
        args = dockerfile_args(recipe)
        labels = " ".join(rest for instruction, rest in dockerfile_instructions(recipe) if instruction == "LABEL")
        assert args.get("MDS_SOURCE") == "local", f"{recipe}: ARG MDS_SOURCE must default to local"
        assert 'org.opencontainers.image.source="${MDS_SOURCE}"' in labels, f"{recipe}: source label != MDS_SOURCE"
        # a RUN after the ARG would see it, so another clone (another URL) would rebuild every layer from there
        steps = dockerfile_instructions(recipe)
        declared = next(i for i, (ins, rest) in enumerate(steps) if ins == "ARG" and rest.startswith("MDS_SOURCE"))
        assert all(ins != "RUN" for ins, _ in steps[declared:]), f"{recipe}: ARG MDS_SOURCE must follow the last RUN"
    elif "MDS_SOURCE" in definition_arguments(recipe):
        assert definition_arguments(recipe)["MDS_SOURCE"] == "local", f"{recipe}: MDS_SOURCE must default to local"
    for line in (ROOT / recipe).read_text().splitlines():
        if "MDS_SOURCE" in line or "image.source" in line:
            assert not URL.search(line), f"{recipe}: the source label names an address: {line.strip()}"


def make_image_source(tmp_path, remote: str | None) -> str:
    """The MDS_SOURCE `make -n image` passes, run in a git repository whose origin is `remote` (None: no origin)."""
    for name in ("Makefile", "cuda/versions", "rocm/versions", "patches/deepspeed/series", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "MDS_"))}
    env.update(DOCKER="docker", PIP_CA="", GIT_CONFIG_NOSYSTEM="1", HOME=str(tmp_path))
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, env=env, check=True)
    if remote is not None:
        subprocess.run(["git", "remote", "add", "origin", remote], cwd=tmp_path, env=env, check=True)
    out = subprocess.run(["make", "-n", "image"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    values = re.findall(r"--build-arg 'MDS_SOURCE=([^']*)'", out.stdout)
    assert len(values) == 1, f"make image passes MDS_SOURCE once: {out.stdout}"
    return values[0]


@pytest.mark.parametrize("remote, label", [
    (None, "local"),
    ("https://github.com/someone/mds.git", "https://github.com/someone/mds.git"),
    ("https://someone:ghp_secret@github.com/someone/mds.git", "https://github.com/someone/mds.git"),
    ("ssh://git@example.org:2222/team/mds.git", "ssh://example.org:2222/team/mds.git"),
    ("git@github.com:someone/mds.git", "git@github.com:someone/mds.git"),
])
def test_make_labels_the_image_with_the_origin_remote(tmp_path, remote, label):
    assert make_image_source(tmp_path, remote) == label


def test_readme_images_table_has_a_row_per_target():
    text = (ROOT / "README.md").read_text()
    assert "## Images" in text
    table = text.split("## Images", 1)[1].split("\n## ", 1)[0]
    for target in MAKE_TARGETS:
        row = next((line for line in table.splitlines() if line.startswith(f"| `make {target}`")), None)
        assert row, f"README Images table: no row for make {target}"
        assert row.count("`") >= 4, f"README Images row for {target} lacks the command that verifies it"


def _extra(name: str) -> list[str]:
    """pyproject.toml's optional-dependencies list `name` (requirement strings)."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]


def test_every_image_installs_the_wandb_and_image_extras(tmp_path):
    """install-deps.sh installs the core, `image` and `wandb` (--wandb-project works in every image), and every
    recipe runs it on the repository's pyproject.toml."""
    script = (ROOT / "docker" / "steps" / "install-deps.sh").read_text()
    program = re.search(r"<<'PY'\n(.*?)\nPY\n", script, re.S)
    assert program, "install-deps.sh: no requirement-list program"
    (tmp_path / "requirements.py").write_text(program.group(1))
    out = subprocess.run([sys.executable, str(tmp_path / "requirements.py"), str(ROOT / "pyproject.toml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    installed = out.stdout.split()
    tomllib = pytest.importorskip("tomllib")
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert installed == [*core, *_extra("image"), *_extra("wandb")]
    assert any(r.startswith("wandb") for r in installed)
    for recipe in [*DOCKERFILES, "apptainer/lumi.def"]:
        assert re.search(r"install-deps\.sh /opt/mds/(deps|src)/pyproject\.toml", (ROOT / recipe).read_text()), \
            f"{recipe}: does not run install-deps.sh on pyproject.toml"


def test_make_test_installs_wandb():
    """`make test` installs megatron_ds[test]: the W&B tests run against a real wandb."""
    assert set(_extra("wandb")) <= set(_extra("test"))
