//! Several processes of one run: two children of this test binary run as
//! ranks 0 and 1 on the CPU (`MEMLAB_RANK`, `WORLD_SIZE`), write their files
//! under the default names into one directory, rank 1 running out of memory
//! on the way; `memlab merge` puts them in one trace and one page. Both
//! children block on a pipe the parent writes to at one moment, then call a
//! profiled function: the two calls land within a millisecond of each other
//! on the merged axis, whenever each process's clock started.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::common::chromium::Browser;
use crate::common::{child, floats};
use memlab::export::Exporter;
use memlab::OomRecorder;
use memlab_cli::merge::{merge, Options};
use tch::{Kind, Tensor};

const CHILD: &str = "rank_child";
/// What a child prints when it is about to wait for the parent's byte.
const READY: &str = "memlab-test: ready";

#[memlab::profile(device = "cpu")]
fn marker() -> usize {
    let t = floats(16);
    t.numel()
}

/// The body of each rank: holds 8 MiB (rank 0) or 2 MiB (rank 1), waits for
/// the parent's byte, calls `marker`; rank 1 then asks for 2^48 bytes, which
/// fails and is reported; both write their files.
#[test]
fn rank_child() {
    if !child(CHILD) {
        return;
    }
    let run = memlab::run::this_process();
    let rank = run.rank.expect("the parent sets MEMLAB_RANK");
    assert_eq!(run.world_size, Some(2));
    let dir = PathBuf::from(std::env::var("MEMLAB_TEST_DIR").unwrap());
    OomRecorder::new(&dir).arm().unwrap();
    let recording = memlab::Recording::start(memlab::events::Settings::default()).unwrap();
    let held = floats(if rank == 0 { 2 << 20 } else { 512 << 10 });
    println!("{READY}");
    std::io::stdout().flush().unwrap();
    // Unbuffered: one byte of the pipe the other rank reads too.
    let mut stdin = std::fs::File::from(std::os::fd::AsFd::as_fd(&std::io::stdin()).try_clone_to_owned().unwrap());
    let mut go = [0u8];
    stdin.read_exact(&mut go).unwrap();
    // The wall clock on both sides of the marker call: the scheduler may
    // wake the two ranks some milliseconds apart, and on a busy machine
    // take either off the processor between a reading and the call.
    let wall = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros();
    let before = wall();
    assert_eq!(marker(), 16);
    let after = wall();
    std::fs::write(dir.join(format!("woke_rank{rank}.txt")), format!("{before} {after}")).unwrap();
    if rank == 1 {
        assert!(Tensor::f_empty([1i64 << 46], (Kind::Float, tch::Device::Cpu)).is_err());
    }
    drop(held);
    let written = Exporter::registered().write_files(&dir).unwrap();
    let suffix = format!("_rank{rank}.");
    assert!(written.iter().all(|p| p.to_str().unwrap().contains(&suffix)), "{written:?}");
    drop(recording);
}

fn spawn(rank: u32, dir: &Path, stdin: std::io::PipeReader) -> Child {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", &crate::common::test_path(CHILD), "--nocapture", "--test-threads=1"])
        .env("MEMLAB_CHILD", crate::common::test_path(CHILD))
        .env("MEMLAB_RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("MEMLAB_TEST_DIR", dir)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in ["MEMLAB_DISABLE", "MEMLAB_PRINT_AT_EXIT", "MEMLAB_OOM_DIR"] {
        command.env_remove(var);
    }
    for (rank, _) in memlab::run::RANK_VARIABLES.iter().skip(1) {
        command.env_remove(rank);
    }
    command.spawn().unwrap()
}

/// Waits (a minute at most) until the child says it is ready; its output
/// is read on by a thread after that, so it never blocks on a full pipe.
fn wait_ready(child: &mut Child) {
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            // libtest may print "test rank_child ... " before it on the same line.
            if line.contains(READY) {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(std::time::Duration::from_secs(60)).is_err() {
        let _ = child.kill();
        panic!("the child did not get ready within a minute");
    }
}

#[test]
fn two_ranks_merge_into_one_trace_and_page() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memlab-ranks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Rank 1 starts first: the two clocks start apart.
    // One pipe is both children's standard input.
    let (reader, mut writer) = std::io::pipe().unwrap();
    let mut one = spawn(1, &dir, reader.try_clone().unwrap());
    wait_ready(&mut one);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut zero = spawn(0, &dir, reader);
    wait_ready(&mut zero);
    // Both are blocked reading it: one write wakes them at one moment.
    std::thread::sleep(std::time::Duration::from_millis(100));
    writer.write_all(b"gg").unwrap();
    drop(writer);
    for (rank, child) in [(0, zero), (1, one)] {
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "rank {rank}: {}", String::from_utf8_lossy(&out.stderr));
    }

    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pickle" || e == "json"))
        .map(|p| p.to_str().unwrap().to_string())
        .collect();
    files.sort();
    let names: Vec<&str> = files.iter().map(|f| Path::new(f).file_name().unwrap().to_str().unwrap()).collect();
    for name in ["memlab_snapshot_rank0.pickle", "memlab_trace_rank0.json", "memlab_snapshot_rank1.pickle"] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    let oom_json =
        files.iter().find(|f| f.contains("memlab_oom_") && f.ends_with("_rank1.json")).expect("rank 1's report");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(oom_json).unwrap()).unwrap();
    // The report says which process of the run failed, in its text and JSON.
    assert_eq!((report["run"]["rank"].as_u64(), report["run"]["world_size"].as_u64()), (Some(1), Some(2)));
    let text = std::fs::read_to_string(oom_json.replace(".json", ".txt")).unwrap();
    assert!(text.contains("rank 1 of 2; libtorch ") && text.contains("recording's clock zero"), "{text}");

    let out = dir.join("merged");
    let merged = merge(&files, &Options { out: out.clone(), offsets: Default::default() }).unwrap();
    // One row per rank, in rank order; rank 0's higher CPU peak marked.
    assert_eq!(merged.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), [Some(0), Some(1)]);
    let cpu = |rank: usize| merged.ranks[rank].devices.iter().find(|d| d.device == "cpu").unwrap().clone();
    let (cpu0, cpu1) = (cpu(0), cpu(1));
    assert!(cpu0.allocated >= 8 << 20 && cpu1.allocated >= 2 << 20 && cpu1.allocated < 8 << 20, "{cpu0:?} {cpu1:?}");
    assert!(cpu0.highest && !cpu1.highest);
    // Rank 1's failure, with its report's verdict and statement.
    assert_eq!(merged.ooms.len(), 1, "{:?}", merged.ooms);
    let oom = &merged.ooms[0];
    assert_eq!((oom.rank, oom.device.as_str(), oom.requested), (Some(1), "cpu", 1u64 << 48));
    assert_eq!(oom.verdict.map(|v| v.as_str()), report["diagnosis"]["verdict"].as_str());
    assert!(oom.verdict.is_some());

    // The trace: a process per rank; the two marker calls at one moment.
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&merged.trace).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let process = |pid: u64| {
        events.iter().find(|e| e["name"] == "process_name" && e["pid"] == pid).unwrap()["args"]["name"].clone()
    };
    assert!(process(1).as_str().unwrap().starts_with("rank 0 ("), "{}", process(1));
    assert!(process(2).as_str().unwrap().starts_with("rank 1 ("), "{}", process(2));
    let marker_at = |pid: u64| {
        events
            .iter()
            .find(|e| e["ph"] == "X" && e["pid"] == pid && e["name"].as_str().is_some_and(|n| n.ends_with("marker")))
            .unwrap_or_else(|| panic!("rank {}'s marker call in the merged trace", pid - 1))["ts"]
            .as_f64()
            .unwrap()
    };
    // Each call lies on the merged axis where its rank's wall clock put it:
    // between the readings on both sides of it, within a millisecond. Both
    // ranks' clocks placed right, the two calls are as far apart as they
    // were on the wall clock.
    let woke = |rank: u32| -> (f64, f64) {
        let text = std::fs::read_to_string(dir.join(format!("woke_rank{rank}.txt"))).unwrap();
        let (before, after) = text.split_once(' ').unwrap();
        let at = |t: &str| (t.parse::<i64>().unwrap() - merged.origin_unix_us) as f64;
        (at(before), at(after))
    };
    for (pid, rank) in [(1, 0), (2, 1)] {
        let (t, (before, after)) = (marker_at(pid), woke(rank));
        println!("rank {rank}'s marker call at {t:.0} µs, between wall-clock readings at {before:.0} and {after:.0}");
        assert!(before - 1000.0 <= t && t <= after + 1000.0, "rank {rank}: merged {t}, wall clock {before}..{after}");
    }
    assert!(events.iter().any(|e| e["ph"] == "i" && e["pid"] == 2), "rank 1's failure as an instant");

    // The page, as a person sees it.
    let page = std::fs::read_to_string(&merged.page).unwrap();
    let verdict = report["diagnosis"]["verdict"].as_str().unwrap().replace('_', " ");
    assert!(page.contains("ran out of memory on cpu") && page.contains(&format!("verdict: {verdict}")), "{page}");
    let statement = oom.statement.as_deref().expect("the recorder names the statement");
    assert!(statement.contains("cpu/ranks.rs"), "{statement}");
    if let Some(mut browser) = Browser::launch(1100, 1400) {
        let mut tab = browser.open(&format!("file://{}", merged.page));
        assert_eq!(tab.console_errors(), Vec::<String>::new(), "no console errors or CSP violations");
        let text = tab.eval("document.body.innerText").as_str().unwrap_or_default().to_string();
        assert!(text.contains("highest") && text.contains("out of memory"), "{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

const PRINT_RUN: &str = "print_run_child";
/// What a child prints before its `RunInfo`'s JSON.
const RUN_IS: &str = "memlab-test-run: ";

/// The body of [`run_under`]'s child: prints what memlab read of its rank.
#[test]
fn print_run_child() {
    if !child(PRINT_RUN) {
        return;
    }
    let run = memlab::run::this_process();
    println!("{RUN_IS}{}", serde_json::to_string(&run).unwrap());
}

/// `this_process()` in a child whose environment has `env` and no other
/// rank or world-size variable; with what it warned.
fn run_under(env: &[(&str, &str)]) -> (memlab::run::RunInfo, String) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    let name = crate::common::test_path(PRINT_RUN);
    command.args(["--exact", &name, "--nocapture", "--test-threads=1"]).env("MEMLAB_CHILD", &name);
    for (rank, size) in memlab::run::RANK_VARIABLES {
        command.env_remove(rank);
        if let Some(size) = size {
            command.env_remove(size);
        }
    }
    command.envs(env.iter().copied());
    let out = command.output().unwrap();
    let (stdout, stderr) = (crate::common::text(&out.stdout), crate::common::text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let json = stdout.lines().find_map(|l| l.split_once(RUN_IS)).map(|(_, json)| json).expect("the child printed it");
    (serde_json::from_str(json).unwrap(), stderr)
}

/// A world size that is no number is left out on its own: the rank stays
/// (and with it the files' `_rank1`), and the warning says what the world
/// size should hold.
#[test]
fn a_bad_world_size_keeps_the_rank() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    let (run, stderr) = run_under(&[("RANK", "1"), ("WORLD_SIZE", "abc")]);
    assert_eq!((run.rank, run.world_size, run.file_suffix().as_str()), (Some(1), None, "_rank1"), "{stderr}");
    assert!(
        stderr.contains("WORLD_SIZE=\"abc\" is not a whole number: set it to how many processes the run has"),
        "{stderr}"
    );
    assert!(!stderr.contains("this process's rank"), "the warning speaks of the world size only: {stderr}");
}

/// Processes started by Slurm's `srun` or by an MPI launcher know their
/// rank and world size from the launcher's own variables.
#[test]
fn ranks_from_slurm_and_mpi_launchers() {
    if std::env::var_os("MEMLAB_CHILD").is_some() {
        return;
    }
    /// The launcher's variables, and the rank and world size they give.
    type Case<'a> = (&'a [(&'a str, &'a str)], (u32, Option<u32>));
    let cases: [Case; 4] = [
        (&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "1")], (3, Some(4))),
        // Open MPI inside a Slurm allocation: the batch script's task id is every process's.
        (&[("SLURM_PROCID", "0"), ("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "8")], (2, Some(8))),
        (&[("PMI_RANK", "5"), ("PMI_SIZE", "6")], (5, Some(6))),
        (&[("PMIX_RANK", "7")], (7, None)),
    ];
    for (env, (rank, world_size)) in cases {
        let (run, stderr) = run_under(env);
        assert_eq!((run.rank, run.world_size), (Some(rank), world_size), "under {env:?}: {stderr}");
        assert_eq!(run.file_suffix(), format!("_rank{rank}"));
        assert!(!stderr.contains("memlab:"), "no warning under {env:?}: {stderr}");
    }
}
