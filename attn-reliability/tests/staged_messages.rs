//! The chunk ring's host-staged messages are sized once, before they are filled: no append
//! of rows (in `T`) or of f32 accumulators (dk/dv travelling with their k/v, the head
//! all-to-alls' gradient into the LSE, out and lse, dq/dk/dv) allocates on its thread, as
//! the counting allocator sees it; a message grown by pushing would reallocate at some
//! append. Ulysses, the hybrid and the ring, forward and backward, over host-staged threads.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use attn_core::error::TensorName;
use attn_core::{AttnShape, DilatedConfig, Result, Shape4, TensorView};
use attn_reliability::counting_alloc::{CountingAlloc, thread_allocations_during};
use attn_ring::chunk_ring::{
    ChunkBlock, ChunkCompute, ChunkGrads, ChunkOptions, ChunkUpstream, CpuChunks, HeadSlot, HostAcc, HostPartial,
    HostRowStats, HostRows, HostTransport, chunk_backward, chunk_forward, rank_pieces,
};
use attn_ring::{Layout, RingProblem, Strategy, ThreadComm};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

type Masks = <CpuChunks as ChunkCompute<f32>>::Masks;

/// The CPU compute, counting the appends to staged messages and noting any that allocated.
#[derive(Default)]
struct Watched {
    cpu: CpuChunks,
    rows: AtomicUsize,
    accs: AtomicUsize,
    grown: Mutex<Vec<String>>,
}

impl Watched {
    /// Run the append `f` of `what`, counting the allocations it makes on this thread.
    fn append(&self, what: &str, out: &mut Vec<u8>, f: impl FnOnce(&mut Vec<u8>) -> Result<()>) -> Result<()> {
        let before = (out.len(), out.capacity());
        let (r, n) = thread_allocations_during(|| f(out));
        let counter = if what == "rows" { &self.rows } else { &self.accs };
        counter.fetch_add(1, Ordering::Relaxed);
        if n > 0 {
            let now = (out.len(), out.capacity());
            let note = format!("{what}: {n} allocations, (len, capacity) {before:?} -> {now:?}");
            self.grown.lock().expect("notes").push(note);
        }
        r
    }
}

impl ChunkCompute<f32> for Watched {
    type Rows = HostRows<f32>;
    type Partial = HostPartial;
    type Acc = HostAcc;
    type RowStats = HostRowStats;
    type Masks = Masks;

    fn shape_of(&self, rows: &HostRows<f32>) -> Shape4 {
        rows.shape
    }
    fn masks(&self, problem: &RingProblem) -> Result<Masks> {
        ChunkCompute::<f32>::masks(&self.cpu, problem)
    }
    fn empty_partial(&self, q: Shape4) -> Result<HostPartial> {
        ChunkCompute::<f32>::empty_partial(&self.cpu, q)
    }
    fn zero_acc(&self, shape: Shape4) -> Result<HostAcc> {
        ChunkCompute::<f32>::zero_acc(&self.cpu, shape)
    }
    fn forward_block(&self, b: &ChunkBlock<'_, HostRows<f32>, Masks>, p: &mut HostPartial) -> Result<()> {
        self.cpu.forward_block(b, p)
    }
    fn finish_forward(&self, problem: &RingProblem, p: &HostPartial) -> Result<(HostRows<f32>, HostRowStats)> {
        self.cpu.finish_forward(problem, p)
    }
    fn delta(
        &self,
        grad_out: &HostRows<f32>,
        out: &HostRows<f32>,
        lse_grad: Option<(&HostRowStats, &HostRowStats)>,
    ) -> Result<HostRowStats> {
        self.cpu.delta(grad_out, out, lse_grad)
    }
    fn stats_shape(&self, stats: &HostRowStats) -> Option<Shape4> {
        ChunkCompute::<f32>::stats_shape(&self.cpu, stats)
    }
    fn stats_from_bsh(&self, shape: Shape4, values: &[f32]) -> Result<HostRowStats> {
        ChunkCompute::<f32>::stats_from_bsh(&self.cpu, shape, values)
    }
    fn backward_block(
        &self,
        b: &ChunkBlock<'_, HostRows<f32>, Masks>,
        up: &ChunkUpstream<'_, HostRows<f32>, HostRowStats>,
        grads: ChunkGrads<'_, HostAcc>,
    ) -> Result<()> {
        self.cpu.backward_block(b, up, grads)
    }
    fn store_acc(&self, acc: &HostAcc) -> Result<HostRows<f32>> {
        self.cpu.store_acc(acc)
    }
    fn rows_to_bytes(&self, rows: &HostRows<f32>, out: &mut Vec<u8>) -> Result<()> {
        self.append("rows", out, |out| self.cpu.rows_to_bytes(rows, out))
    }
    fn rows_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<HostRows<f32>> {
        self.cpu.rows_from_bytes(shape, bytes)
    }
    fn acc_to_bytes(&self, acc: &HostAcc, out: &mut Vec<u8>) -> Result<()> {
        self.append("accumulator", out, |out| ChunkCompute::<f32>::acc_to_bytes(&self.cpu, acc, out))
    }
    fn acc_from_bytes(&self, shape: Shape4, bytes: &[u8]) -> Result<HostAcc> {
        ChunkCompute::<f32>::acc_from_bytes(&self.cpu, shape, bytes)
    }
    fn acc_bytes(&self, acc: &HostAcc) -> usize {
        ChunkCompute::<f32>::acc_bytes(&self.cpu, acc)
    }
    fn slice_rows(&self, src: &HostRows<f32>, rows: std::ops::Range<usize>) -> Result<HostRows<f32>> {
        self.cpu.slice_rows(src, rows)
    }
    fn zero_rows(&self, shape: Shape4) -> Result<HostRows<f32>> {
        self.cpu.zero_rows(shape)
    }
    fn write_rows(&self, dst: &mut HostRows<f32>, at: usize, src: &HostRows<f32>) -> Result<()> {
        self.cpu.write_rows(dst, at, src)
    }
    fn sync(&self) -> Result<()> {
        ChunkCompute::<f32>::sync(&self.cpu)
    }
    fn take_heads(&self, src: &HostRows<f32>, heads: std::ops::Range<usize>) -> Result<HostRows<f32>> {
        self.cpu.take_heads(src, heads)
    }
    fn put_heads(&self, dst: &mut HostRows<f32>, first: usize, src: &HostRows<f32>) -> Result<()> {
        self.cpu.put_heads(dst, first, src)
    }
    fn take_acc_heads(&self, src: &HostAcc, heads: std::ops::Range<usize>) -> Result<HostAcc> {
        ChunkCompute::<f32>::take_acc_heads(&self.cpu, src, heads)
    }
    fn add_acc_heads(&self, dst: &mut HostAcc, first: usize, src: &HostAcc) -> Result<()> {
        ChunkCompute::<f32>::add_acc_heads(&self.cpu, dst, first, src)
    }
    fn stats_as_acc(&self, stats: &HostRowStats) -> Result<HostAcc> {
        ChunkCompute::<f32>::stats_as_acc(&self.cpu, stats)
    }
    fn acc_as_stats(&self, acc: &HostAcc) -> Result<HostRowStats> {
        ChunkCompute::<f32>::acc_as_stats(&self.cpu, acc)
    }
    fn finish_forward_slot(
        &self,
        problem: &RingProblem,
        p: &HostPartial,
        slot: HeadSlot,
    ) -> Result<(HostRows<f32>, HostRowStats)> {
        self.cpu.finish_forward_slot(problem, p, slot)
    }
}

/// Forward and backward of `problem` on its ranks as threads, host-staged, each rank's
/// compute watching its appends; returns every rank's compute.
fn run(problem: &RingProblem) -> Vec<Watched> {
    let comms = ThreadComm::world(problem.world).expect("threads");
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, mut comm)| {
                s.spawn(move || {
                    let pieces = |heads: usize| -> Vec<HostRows<f32>> {
                        let shape = Shape4::new(problem.batch, problem.seq, heads, problem.head_dim).expect("shape");
                        let x: Vec<f32> = (0..shape.numel()).map(|i| (i as f32 * 0.29).cos()).collect();
                        let view = TensorView::contiguous(TensorName::Query, &x, shape).expect("view");
                        rank_pieces(problem, r)
                            .into_iter()
                            .map(|g| HostRows::from_view_rows(&view, g).expect("piece"))
                            .collect()
                    };
                    let (q, kv) = (pieces(problem.heads), pieces(problem.kv_heads));
                    let (x, opts) = (Watched::default(), ChunkOptions::default());
                    let mut t = HostTransport::new(&mut comm);
                    chunk_forward(&mut t, &x, problem, opts, [&q, &kv, &kv]).expect("forward");
                    chunk_backward(&mut t, &x, problem, opts, [&q, &kv, &kv], &q, None).expect("backward");
                    x
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

#[test]
fn staged_messages_are_sized_before_they_are_filled() {
    let dense = DilatedConfig::builder().segments(&[32]).dilations(&[1]).causal().build().expect("config");
    let shape = AttnShape { q: Shape4::new(1, 32, 4, 8).expect("q"), kv: Shape4::new(1, 32, 2, 8).expect("kv") };
    for strategy in [Strategy::Ulysses, Strategy::Hybrid { ulysses: 2 }, Strategy::Ring] {
        let problem = RingProblem::new(&dense, shape, Layout::Zigzag, strategy, 4);
        let ranks = run(&problem);
        let (rows, accs): (usize, usize) = ranks
            .iter()
            .map(|x| (x.rows.load(Ordering::Relaxed), x.accs.load(Ordering::Relaxed)))
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let grown: Vec<String> = ranks.iter().flat_map(|x| x.grown.lock().expect("notes").clone()).collect();
        assert!(grown.is_empty(), "{strategy:?}: appends that grew their message: {grown:?}");
        assert!(rows > 0 && accs > 0, "{strategy:?}: {rows} row and {accs} accumulator appends");
        println!("{strategy:?}: {rows} row and {accs} accumulator appends, none allocating");
    }
}
