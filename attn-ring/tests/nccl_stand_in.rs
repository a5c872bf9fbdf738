//! The real NCCL transport (`NcclComm`: libnccl as `nccl_library` finds it, the
//! non-blocking communicator of `nccl_handle`, `GroupedComm` on top) run end to end on a
//! machine without a GPU. `tests/stand_in_gpu/stand_in_gpu.c` is compiled into one shared
//! object reached as `libcuda.so` and as `libnccl.so.2`, NCCL's own file name (its header
//! says what it models),
//! and this test binary runs itself again with that directory first on
//! `LD_LIBRARY_PATH` (the loader reads it at start-up only). In the child: every
//! golden file of `dilated/` and `features/` through the ring over 2..=4 NCCL ranks on threads, forward and
//! gradients; the unique id sent over another communicator; a rank that never joins,
//! two ranks on one GPU, an error NCCL reports, every fault at every frame: typed
//! errors within the timeout. The stand-in is a model: this proves our
//! side of the NCCL calls, not NCCL's behaviour on a GPU.
#![cfg(all(feature = "nccl", target_os = "linux"))]

use crate::common;
#[cfg(feature = "cuda")]
#[path = "stand_in_gpu/device_all_to_all.rs"]
mod device_all_to_all;
#[cfg(feature = "cuda")]
#[path = "stand_in_gpu/device_ring.rs"]
mod device_ring;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Mixing, Result, Shape4, TensorView};
use attn_ring::comm::{NcclComm, nccl_available};
use attn_ring::{Communicator, Fault, FaultyComm, Layout, Strategy, ThreadComm, forward_on, problem_for};
use attn_testkit::random_vec;
use common::{CommBackend, faults_at, golden_sweep};

/// Set in the child process, which sees the stand-in libraries.
const CHILD: &str = "ATTN_NCCL_STAND_IN_CHILD";
/// Well above any healthy round; a deadlock fails a run with `Timeout`.
const TIMEOUT: Duration = Duration::from_secs(20);
/// The child takes a few seconds; one that runs this long hangs and is killed.
const CHILD_LIMIT: Duration = Duration::from_secs(300);

/// Compile the stand-in into `dir` and link it there as libcuda.so and libnccl.so.2.
fn build_stand_in(dir: &Path) {
    std::fs::create_dir_all(dir).expect("stand-in directory");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/stand_in_gpu/stand_in_gpu.c");
    let object = dir.join("libattn_stand_in_gpu.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread", "-o"])
        .arg(&object)
        .arg(&source)
        .status()
        .unwrap_or_else(|e| panic!("could not run the C compiler `{cc}` (set CC): {e}"));
    assert!(status.success(), "compiling {} failed", source.display());
    for name in ["libcuda.so", "libnccl.so.2"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&object, &link).expect("symlink");
    }
}

#[test]
fn nccl_transport_runs_against_stand_in_libraries() {
    run_child("stand_in_child");
}

/// The chunk ring's all-to-all over NCCL between (stand-in) device buffers, in a child of
/// its own.
#[cfg(feature = "cuda")]
#[test]
fn device_all_to_all_runs_against_stand_in_libraries() {
    run_child("all_to_all_child");
}

/// Run the ignored test `child` of this module in a child process that sees the stand-in
/// libraries, and require that it passed.
fn run_child(child: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("stand_in_gpu-{}-{child}", std::process::id()));
    build_stand_in(&dir);
    let mut path = dir.clone().into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let me = std::env::current_exe().expect("test binary");
    let mut child = Command::new(me)
        .args(["--ignored", "--exact", &child_test_name(child), "--nocapture", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", path)
        .env(CHILD, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the child");
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("child status") {
            break Some(status);
        }
        if start.elapsed() > CHILD_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = std::fs::remove_dir_all(&dir);
    let (stdout, stderr) = (stdout.join().expect("stdout"), stderr.join().expect("stderr"));
    println!("--- child stdout ---\n{stdout}\n--- child stderr ---\n{stderr}");
    let status = status.unwrap_or_else(|| panic!("the child hung: killed after {CHILD_LIMIT:?}"));
    assert!(status.success(), "the child failed: {status:?}");
    assert!(stdout.contains("test result: ok. 1 passed"), "the child ran no test");
}

/// The child test `child`'s name as the harness lists it: its path below the crate root.
fn child_test_name(child: &str) -> String {
    match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::{child}"),
        None => child.into(),
    }
}

/// Read a child's pipe to the end on a thread (so a full pipe cannot block the child).
fn drain(pipe: Option<impl std::io::Read + Send + 'static>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

/// Join `world` NCCL ranks (GPU i for rank i), each on its own thread, as creation
/// waits for every rank.
fn nccl_world(world: usize, timeout: Duration) -> Result<Vec<NcclComm>> {
    let id = NcclComm::unique_id()?;
    std::thread::scope(|s| {
        let joins: Vec<_> =
            (0..world).map(|rank| s.spawn(move || NcclComm::with_timeout(rank, world, rank, &id, timeout))).collect();
        joins.into_iter().map(|h| h.join().expect("join thread")).collect()
    })
}

/// `conformance/dilated` and `conformance/features` (grouped k/v heads, key padding,
/// packed sequences, windows): 9 files each, worlds 2..=4, both layouts, three strategies.
fn golden_files_pass() {
    for dir in ["dilated", "features"] {
        let runs = golden_sweep(dir, 2..=4, |world, layout, strategy| CommBackend {
            label: "stand-in nccl",
            world,
            layout,
            strategy,
            join: |p| nccl_world(p, TIMEOUT),
        });
        assert_eq!(runs.len(), 9 * 3 * 2 * 3, "{dir}");
        println!("golden: {dir}: {} runs over stand-in NCCL passed (forward and gradients)", runs.len());
    }
}

fn frames_of_every_size_round_trip() {
    let mut comms = nccl_world(2, TIMEOUT).expect("two ranks");
    let big: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let (b, a) = (comms.pop().unwrap(), comms.pop().unwrap());
    let got = std::thread::scope(|s| {
        let send = |mut c: NcclComm, peer: usize, frames: Vec<Vec<u8>>| {
            s.spawn(move || {
                let n = frames.len();
                c.exchange_frames(frames.into_iter().map(|f| (peer, f)).collect(), &vec![peer; n])
            })
        };
        let ha = send(a, 1, vec![Vec::new(), vec![1, 2, 3], big.clone()]);
        let hb = send(b, 0, vec![vec![9], Vec::new(), Vec::new()]);
        (ha.join().unwrap().expect("rank 0"), hb.join().unwrap().expect("rank 1"))
    });
    assert_eq!(got.0, vec![vec![9], Vec::new(), Vec::new()]);
    assert_eq!(got.1, vec![Vec::new(), vec![1, 2, 3], big]);
}

/// The unique id travels over another communicator (here threads; MPI in a real job).
fn bootstrap_over_another_communicator() {
    let threads = ThreadComm::world_with_timeout(3, TIMEOUT).unwrap();
    let gathered = std::thread::scope(|s| {
        let hs: Vec<_> = threads
            .into_iter()
            .map(|mut over| {
                s.spawn(move || {
                    let device = over.rank();
                    let mut nccl = NcclComm::bootstrap(&mut over, device, TIMEOUT)?;
                    nccl.all_gather(vec![device as u8; device + 1])
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for got in gathered {
        assert_eq!(got.expect("NCCL all_gather"), vec![vec![0], vec![1, 1], vec![2, 2, 2]]);
    }
}

/// NCCL reports a failed connection (`ncclRemoteError`, injected by the stand-in on each
/// rank's third group): a `Comm` error naming it, the communicator aborted, and every
/// later exchange refused at once.
fn an_error_nccl_reports_aborts_the_communicator() {
    let mut id = [0u8; 128];
    id[..20].copy_from_slice(b"remote-error-after 2");
    let ranks: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let mut c = NcclComm::with_timeout(rank, 2, rank, &id, Duration::from_secs(5)).expect("join");
                    let peer = 1 - rank;
                    // One exchange is two groups (lengths, then frames); the third group fails.
                    let first = c.exchange_frames(vec![(peer, vec![rank as u8; 3])], &[peer]);
                    let start = Instant::now();
                    let second = c.exchange_frames(vec![(peer, vec![7])], &[peer]);
                    let waited = start.elapsed();
                    let third = c.exchange_frames(vec![(peer, vec![8])], &[peer]);
                    (first, second, waited, third)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (first, second, waited, third)) in ranks.into_iter().enumerate() {
        assert_eq!(first.expect("first exchange"), vec![vec![(1 - rank) as u8; 3]]);
        match second {
            Err(AttnError::Comm { message, .. }) => assert!(message.contains("ncclRemoteError"), "{message}"),
            other => panic!("rank {rank}: expected NCCL's error, got {other:?}"),
        }
        assert!(waited < Duration::from_secs(2), "rank {rank} noticed only after {waited:?}");
        match third {
            Err(AttnError::Comm { message, .. }) => assert!(message.contains("aborted"), "{message}"),
            other => panic!("rank {rank}: expected the aborted communicator's error, got {other:?}"),
        }
    }
}

fn a_rank_that_never_joins_is_a_timeout() {
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let got = NcclComm::with_timeout(0, 2, 0, &NcclComm::unique_id().unwrap(), timeout);
    let waited = start.elapsed();
    assert!(matches!(got, Err(AttnError::Timeout { rank: 0, peer: 1, timeout_ms: 300 })), "{got:?}");
    assert!(waited >= timeout && waited < Duration::from_secs(5), "gave up after {waited:?}");
    let id = NcclComm::unique_id().unwrap();
    let same_gpu = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2).map(|r| s.spawn(move || NcclComm::with_timeout(r, 2, 0, &id, timeout))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    assert!(same_gpu.iter().all(|r| matches!(r, Err(AttnError::Comm { .. } | AttnError::Timeout { .. }))));
    assert!(
        same_gpu
            .iter()
            .any(|r| matches!(r, Err(AttnError::Comm { message, .. }) if message.contains("ncclInvalidUsage")))
    );
}

/// Rank 1 of 3 suffers one fault on one of its frames, for every frame it sends and
/// every kind of fault (a stalled rank: its frame held past the others' 150 ms timeout;
/// a dead rank: its communicator aborted mid-ring): every rank ends with the clean
/// answer or a typed error, quickly; a dropped, held or dead rank's peers see a
/// `Timeout` (a rendezvous transport has no closed channel to notice).
fn every_fault_on_every_frame_is_an_error_or_the_right_answer() {
    let cfg = DilatedConfig::builder().segments(&[8, 30]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal();
    let (cfg, shape) = (cfg.build().unwrap(), Shape4::new(1, 30, 2, 4).unwrap());
    let x = [11, 12, 13].map(|seed| random_vec(seed, shape.numel()));
    let view = |x| TensorView::contiguous(TensorName::Query, x, shape).unwrap();
    let problem = problem_for(&cfg, shape, Layout::Zigzag, Strategy::Ring, 3);
    let run = |faults: Vec<Fault>, timeout: Duration| {
        let comms = nccl_world(3, timeout).expect("three ranks");
        let comms: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let mine = if c.rank() == 1 { faults.clone() } else { Vec::new() };
                FaultyComm::new(c, mine)
            })
            .collect();
        forward_on(comms, &problem, view(&x[0]), view(&x[1]), view(&x[2]))
    };
    let clean: Vec<_> = run(Vec::new(), TIMEOUT).into_iter().map(|r| r.expect("clean run")).collect();
    // Handshake (2 frames), data, completion tables and verdicts (2 frames each).
    let frames = clean[1].2.data_messages + 6;
    let (mut runs, mut outcomes) = (0, [0usize; 4]);
    for nth in 0..frames {
        for fault in faults_at(nth, Duration::from_millis(500)) {
            let start = Instant::now();
            let res = run(vec![fault], Duration::from_millis(150));
            assert!(start.elapsed() < Duration::from_secs(5), "{fault:?} took {:?}", start.elapsed());
            for (rank, r) in res.iter().enumerate() {
                match r {
                    Ok((out, lse, _)) => {
                        assert_eq!((out, lse), (&clean[rank].0, &clean[rank].1), "wrong answer: {fault:?}")
                    }
                    Err(AttnError::Comm { .. } | AttnError::Timeout { .. } | AttnError::RankDisagreement(_)) => {}
                    Err(e) => panic!("{fault:?}: rank {rank} failed with an untyped error: {e}"),
                }
            }
            if matches!(fault, Fault::Drop { .. } | Fault::Kill { .. } | Fault::Delay { .. }) && nth + 2 < frames {
                assert!(res.iter().any(|r| matches!(r, Err(AttnError::Timeout { .. }))), "{fault:?}: {res:?}");
            }
            runs += 1;
            outcomes[res.iter().filter(|r| r.is_err()).count()] += 1;
        }
    }
    println!(
        "faults: {runs} runs over stand-in NCCL ({frames} frames of rank 1 x 7 faults); runs by ranks failing \
         with a typed error (0, 1, 2, 3 of 3): {outcomes:?}; every other rank had the clean answer"
    );
}

/// Whether this process is the child that sees the stand-in libraries (checked loaded);
/// elsewhere the child test `child` says it only runs under `parent`.
fn in_child(child: &str, parent: &str) -> bool {
    if std::env::var_os(CHILD).is_none() {
        eprintln!("{child} only runs under {parent}");
        return false;
    }
    assert_eq!(nccl_available().expect("the stand-in libraries are loaded"), 8);
    true
}

#[test]
#[ignore = "runs in the child process of nccl_transport_runs_against_stand_in_libraries"]
fn stand_in_child() {
    if !in_child("stand_in_child", "nccl_transport_runs_against_stand_in_libraries") {
        return;
    }
    frames_of_every_size_round_trip();
    bootstrap_over_another_communicator();
    a_rank_that_never_joins_is_a_timeout();
    an_error_nccl_reports_aborts_the_communicator();
    every_fault_on_every_frame_is_an_error_or_the_right_answer();
    golden_files_pass();
    #[cfg(feature = "cuda")]
    device_ring::device_transport_matches_host_staging();
    #[cfg(feature = "cuda")]
    device_ring::ranks_out_of_step_fail_at_the_header();
    #[cfg(feature = "cuda")]
    device_ring::a_link_serves_later_calls();
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "runs in the child process of device_all_to_all_runs_against_stand_in_libraries"]
fn all_to_all_child() {
    if !in_child("all_to_all_child", "device_all_to_all_runs_against_stand_in_libraries") {
        return;
    }
    device_all_to_all::every_part_reaches_its_member();
    device_all_to_all::a_size_the_receiver_does_not_expect_fails_at_the_header();
    device_all_to_all::a_member_dying_mid_exchange_is_an_error_on_every_rank();
}
