//! Faults in a multi-piece all-gather and ring pass with two compute threads per
//! rank (messages spread over rounds, pieces posted one round ahead, workers running
//! while a frame fails): every rank returns a typed error within the timeout and no
//! caller output or LSE value is written.

use std::time::{Duration, Instant};

use attn_core::error::TensorName;
use attn_core::{AttnError, DilatedConfig, Mixing, Shape4, TensorView, TensorViewMut};
use attn_ring::{
    Communicator, Fault, FaultyComm, Layout, RingOptions, Strategy, ThreadComm, local_rows, problem_for,
    ring_forward_with,
};
use attn_testkit::random_vec;

const P: usize = 3;
const SEQ: usize = 1800;
const SENTINEL: f32 = 7.0;

/// Every rank's result (data frames it sent) and whether its outputs still hold the
/// sentinel, with `faults` on rank 1's outgoing frames.
fn run(strategy: Strategy, faults: &[Fault], timeout: Duration) -> Vec<(Result<u64, AttnError>, bool)> {
    let cfg = DilatedConfig::builder().segments(&[300, 900, SEQ]).dilations(&[1, 2, 3]).mixing(Mixing::LongNet);
    let cfg = cfg.causal().build().unwrap();
    let shape = Shape4::new(1, SEQ, 3, 8).unwrap();
    let qkv = [1, 2, 3].map(|seed| random_vec(seed, shape.numel()));
    let problem = problem_for(&cfg, shape, Layout::Zigzag, strategy, P);
    let opts = RingOptions::default().with_threads(2);
    let comms = ThreadComm::world_with_timeout(P, timeout).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let mine = if c.rank() == 1 { faults.to_vec() } else { Vec::new() };
                let mut comm = FaultyComm::new(c, mine);
                let (qkv, problem, opts) = (&qkv, &problem, &opts);
                s.spawn(move || {
                    let pos = Layout::Zigzag.positions(SEQ, P, comm.rank());
                    let ls = shape.with_seq(pos.len()).unwrap();
                    let [lq, lk, lv] = qkv.each_ref().map(|x| {
                        local_rows(&TensorView::contiguous(TensorName::Query, x, shape).unwrap(), &pos).unwrap()
                    });
                    let view = |x| TensorView::contiguous(TensorName::Query, x, ls).unwrap();
                    let mut out = vec![SENTINEL; ls.numel()];
                    let mut lse = vec![SENTINEL; ls.lse_len()];
                    let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut out, ls).unwrap();
                    let res = ring_forward_with(
                        &mut comm,
                        problem,
                        opts,
                        [view(&lq), view(&lk), view(&lv)],
                        &mut ov,
                        &mut lse,
                    );
                    (res.map(|st| st.data_messages), out.iter().chain(&lse).all(|&x| x == SENTINEL))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn faults_among_many_pieces_fail_every_rank_and_write_nothing() {
    for strategy in [Strategy::AllGather, Strategy::Ring] {
        let clean = run(strategy, &[], Duration::from_secs(10));
        let data = *clean[1].0.as_ref().unwrap();
        assert!(clean.iter().all(|(r, untouched)| r.is_ok() && !untouched), "{strategy:?}: {clean:?}");
        // Rank 1's data frames follow its P-1 handshake frames: the first, middle and last.
        let first = P as u64 - 1;
        for nth in [first, first + data / 2, first + data - 1] {
            let stall = Fault::Delay { nth, delay: Duration::from_millis(600) };
            for fault in
                [Fault::Kill { nth }, Fault::Corrupt { nth }, Fault::Drop { nth }, Fault::Reorder { nth }, stall]
            {
                let start = Instant::now();
                let res = run(strategy, &[fault], Duration::from_millis(200));
                assert!(start.elapsed() < Duration::from_secs(5), "{fault:?} took {:?}", start.elapsed());
                for (rank, (r, untouched)) in res.iter().enumerate() {
                    let typed = matches!(
                        r,
                        Err(AttnError::Comm { .. } | AttnError::Timeout { .. } | AttnError::RankDisagreement(_))
                    );
                    assert!(typed && *untouched, "{strategy:?} {fault:?} rank {rank}: {r:?}, untouched {untouched}");
                }
            }
        }
    }
}
