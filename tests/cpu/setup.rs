//! The environment and set-up as a new user meets them: what the README
//! says a build or a run without the environment prints is what they
//! print, every value the README gives for `MEMLAB_CPU_ALLOCATOR` does what
//! it says, and `scripts/env.sh` sourced twice in one shell picks the venv
//! of the torch asked for.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{check_child, child};
use memlab_core::profiler::{FLAG_OFF, FLAG_ON};

fn workspace() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The README's section `title` (from its heading to the next `## `).
fn readme_section(title: &str) -> String {
    let readme = std::fs::read_to_string(workspace().join("README.md")).unwrap();
    let start = readme.find(&format!("\n## {title}\n")).unwrap_or_else(|| panic!("the README has ## {title}"));
    let rest = &readme[start + 1..];
    let end = rest[3..].find("\n## ").map_or(rest.len(), |e| e + 3);
    rest[..end].to_string()
}

/// `PATH` without the venv of `scripts/env.sh`, as in a fresh shell.
fn path_without_venv() -> String {
    let venv = std::env::var("MEMLAB_VENV").map(|v| format!("{v}/bin")).unwrap_or_default();
    std::env::var("PATH").unwrap_or_default().split(':').filter(|p| *p != venv).collect::<Vec<_>>().join(":")
}

/// torch-sys built in a shell without memlab's environment: it stops with
/// tch's message, the one the README shows beside the line that fixes it.
#[test]
fn a_build_without_the_environment_stops_as_the_readme_shows() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace().join("target"), PathBuf::from);
    let out = Command::new(cargo)
        .current_dir(workspace())
        .args(["build", "--release", "-p", "torch-sys"])
        // Apart from the suite's builds: this one's failed build script must
        // not make cargo build torch-sys again for them.
        .env("CARGO_TARGET_DIR", target.join("no-libtorch"))
        .env("PATH", path_without_venv())
        .env_remove("LIBTORCH_USE_PYTORCH")
        .env_remove("LIBTORCH")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the build stopped:\n{stderr}");
    let section = readme_section("Using memlab in your crate");
    for line in [
        "Cannot find a libtorch install, you can either:",
        "- Use a Python environment with PyTorch installed by setting LIBTORCH_USE_PYTORCH=1",
    ] {
        assert!(stderr.contains(line), "tch says {line:?}:\n{stderr}");
        assert!(section.contains(line), "the README shows {line:?}:\n{section}");
    }
    assert!(section.contains("`source /path/to/memlab/scripts/env.sh`"), "the README gives the fix:\n{section}");
}

/// A memlab program run without torch's libraries on `LD_LIBRARY_PATH`
/// stops before `main` with the loader's message the README shows (this
/// test binary is such a program).
#[test]
fn a_run_without_the_library_path_stops_as_the_readme_shows() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let out =
        Command::new(std::env::current_exe().unwrap()).env_remove("LD_LIBRARY_PATH").arg("--list").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it stopped:\n{stderr}");
    let message = "error while loading shared libraries: libtorch_cuda.so: cannot open shared object file: No such file or directory";
    assert!(stderr.contains(message), "the loader says {message:?}:\n{stderr}");
    let section = readme_section("Using memlab in your crate");
    assert!(section.contains(&format!("./target/release/my-program: {message}")), "the README shows it:\n{section}");
}

/// Every value the README gives for `MEMLAB_CPU_ALLOCATOR`, and only those,
/// and each does what it says in a fresh process.
#[test]
fn every_value_the_readme_gives_for_the_cpu_allocator_works() {
    if child("cpu_allocator_child") {
        return;
    }
    let section = readme_section("Allocator figures");
    let paragraph = section.split("\n\n").find(|p| p.contains("`MEMLAB_CPU_ALLOCATOR`")).expect("a paragraph on it");
    for value in FLAG_OFF.iter().chain(&FLAG_ON) {
        assert!(paragraph.contains(&format!("`{value}`")), "the README names {value}:\n{paragraph}");
    }
    let installed = |value: &str| {
        let (stdout, stderr) = check_child("cpu_allocator_child", &[("MEMLAB_CPU_ALLOCATOR", value)]);
        let installed = stdout.contains("memlab-test: installed true");
        assert!(installed || stdout.contains("memlab-test: installed false"), "{stdout}");
        (installed, stderr)
    };
    for value in FLAG_OFF.iter().copied().chain(["OFF", " No ", "False"]) {
        assert!(!installed(value).0, "MEMLAB_CPU_ALLOCATOR={value:?} turns it off");
    }
    for value in FLAG_ON.iter().copied().chain(["", "ON"]) {
        let (on, stderr) = installed(value);
        assert!(on && !stderr.contains("memlab:"), "MEMLAB_CPU_ALLOCATOR={value:?} keeps it: {stderr}");
    }
    let (on, stderr) = installed("disable");
    assert!(on, "another value is refused, and the allocator installed");
    assert_eq!(
        stderr.matches("memlab: ignoring MEMLAB_CPU_ALLOCATOR=\"disable\": write 1, true, yes or on").count(),
        1,
        "{stderr}"
    );
}

/// The child of the test above: says whether the allocator went in at load.
#[test]
fn cpu_allocator_child() {
    if child("cpu_allocator_child") {
        println!("memlab-test: installed {}", memlab::stats::cpu_allocator_installed_at_load());
    }
}

/// A root with `scripts/env.sh` and two venvs whose `python` only answers
/// env.sh's questions (torch's version, torch's folder), and a `python3`
/// first on `PATH` that records any attempt to make a venv or install.
fn fake_root(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("memlab-env-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("scripts")).unwrap();
    std::fs::copy(workspace().join("scripts/env.sh"), root.join("scripts/env.sh")).unwrap();
    let script = |path: PathBuf, body: String| {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, body).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    };
    for (venv, torch) in [(".venv", "2.11.0"), (".venv-2.13.0", "2.13.0"), ("mine", "2.13.0")] {
        script(
            root.join(venv).join("bin/python"),
            format!(
                "#!/bin/sh\nscript=$(cat)\ncase \"$script\" in\n  *metadata*) echo \"{torch} 13.0.88\" ;;\n  \
                 *find_spec*) echo \"{}/torch\" ;;\nesac\n",
                root.join(venv).display()
            ),
        );
    }
    script(root.join("bin/python3"), format!("#!/bin/sh\necho \"$@\" >> {}/installs\nexit 1\n", root.display()));
    root
}

/// Sources `scripts/env.sh` of `root` with each of `steps` (variables set
/// before it) in one bash, and returns what bash printed of the result.
fn source_in_one_shell(root: &Path, steps: &[&str]) -> String {
    let mut script = format!(
        "export PATH={}/bin:/usr/bin:/bin; unset MEMLAB_VENV MEMLAB_VENV_CHOSEN MEMLAB_TORCH LD_LIBRARY_PATH MEMLAB_ADDED_PATH MEMLAB_ADDED_LIBRARY_PATH;",
        root.display()
    );
    for step in steps {
        script.push_str(&format!(" {step} source {}/scripts/env.sh || exit 7;", root.display()));
    }
    script.push_str(r#" echo "venv=$MEMLAB_VENV"; echo "path=$PATH"; echo "libs=$LD_LIBRARY_PATH""#);
    let out = Command::new("bash").arg("-c").arg(&script).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        !root.join("installs").exists(),
        "nothing was installed: {:?}",
        std::fs::read_to_string(root.join("installs"))
    );
    stdout
}

#[test]
fn sourcing_env_sh_again_with_another_torch_switches_venvs() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let root = fake_root("switch");
    let r = root.display();
    let out = source_in_one_shell(&root, &["", "MEMLAB_TORCH=2.13.0"]);
    assert!(out.contains(&format!("venv={r}/.venv-2.13.0\n")), "{out}");
    assert!(out.contains(&format!("path={r}/.venv-2.13.0/bin:{r}/bin:")), "the new venv first: {out}");
    assert!(!out.contains(&format!("{r}/.venv/bin")), "the old venv's entry is gone: {out}");
    assert!(out.contains(&format!("libs={r}/.venv-2.13.0/torch/lib\n")), "only the new torch's libraries: {out}");
    // And back.
    let out = source_in_one_shell(&root, &["", "MEMLAB_TORCH=2.13.0", "MEMLAB_TORCH=2.11.0"]);
    assert!(
        out.contains(&format!("venv={r}/.venv\n")) && out.contains(&format!("libs={r}/.venv/torch/lib\n")),
        "{out}"
    );
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_venv_the_user_names_wins() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let root = fake_root("mine");
    let r = root.display();
    let mine = format!("export MEMLAB_VENV={r}/mine MEMLAB_TORCH=2.13.0;");
    let out = source_in_one_shell(&root, &["", &mine, "MEMLAB_TORCH=2.13.0"]);
    assert!(out.contains(&format!("venv={r}/mine\n")) && out.contains(&format!("libs={r}/mine/torch/lib\n")), "{out}");
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn a_failed_install_says_how_much_disk_it_needs_and_has() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let root = std::env::temp_dir().join(format!("memlab-env-{}-full", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("scripts")).unwrap();
    std::fs::copy(workspace().join("scripts/env.sh"), root.join("scripts/env.sh")).unwrap();
    let script = |path: PathBuf, body: &str| {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, body).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    };
    // Making the venv works; it has no torch, and pip fails as on a full disk.
    script(root.join("bin/python3"), "#!/bin/sh\nexit 0\n");
    script(
        root.join(".venv/bin/python"),
        "#!/bin/sh\ncase \"$*\" in\n  *pip*) echo 'OSError: [Errno 28] No space left on device' >&2; exit 1 ;;\nesac\ncat >/dev/null\nexit 1\n",
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "export PATH={r}/bin:/usr/bin:/bin; unset MEMLAB_VENV MEMLAB_VENV_CHOSEN MEMLAB_TORCH; source {r}/scripts/env.sh",
            r = root.display()
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("pip could not install torch==2.11.0"), "{stderr}");
    assert!(stderr.contains(&format!("free on the disk of {}\n", root.display())), "{stderr}");
    assert!(stderr.contains("it needs about 5.5 GB free"), "{stderr}");
    assert!(root.join(".venv/bin/python").exists(), "the user's venv is left as it was");
    std::fs::remove_dir_all(&root).ok();
}
