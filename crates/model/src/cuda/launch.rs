//! What the op families' kernel launches share (`crate::ops::*::cuda`):
//! the one launch helper, the common grid shapes, and the shape and size
//! checks every wrapper makes before it launches.

use cudarc::driver::{CudaFunction, CudaStream, LaunchArgs, LaunchConfig};

use super::error::Context;
use super::tensor::{CudaTensor, DType, MAX_ELEMENTS};
use super::{CudaError, CudaResult};

/// The most threads any launch of the backend puts in one block. cuda_ptx
/// checks that every kernel's registers and shared memory fit a block this
/// wide on an SM (wider, a GPU refuses the launch for want of resources),
/// and the tests have the emulator refuse any wider launch.
pub const MAX_BLOCK_THREADS: u32 = 256;
/// Threads per block of the elementwise kernels.
pub(crate) const BLOCK: u32 = MAX_BLOCK_THREADS;
/// Grid-stride kernels never need more blocks than this.
pub(crate) const MAX_BLOCKS: usize = 1 << 16;

/// One thread per element (grid-stride past MAX_BLOCKS·BLOCK).
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One thread per channel.
pub(crate) fn per_channel(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// 8 channels by 32 lanes a block (batchnorm.cu's finalize kernels).
pub(crate) fn bn_finalize_lanes(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(8).max(1) as u32, 1, 1),
        block_dim: (8, 32, 1),
        shared_mem_bytes: 0,
    }
}

/// 32 channels by 8 lanes a block (layernorm.cu's finalize kernel).
pub(crate) fn per_channel_lanes(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(32).max(1) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn u32_of(op: &'static str, v: usize) -> CudaResult<u32> {
    if v > MAX_ELEMENTS {
        return Err(CudaError::Unsupported {
            op,
            reason: format!("{v} exceeds the kernels' limit of {MAX_ELEMENTS} elements"),
        });
    }
    Ok(v as u32)
}

/// (rows, columns) of a matrix [rows, cols]; anything else is an error
/// saying what `op` expected.
pub(crate) fn matrix_dims(
    op: &'static str,
    expected: &str,
    t: &CudaTensor,
) -> CudaResult<(usize, usize)> {
    match *t.shape() {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(CudaError::shape(op, expected, format!("{:?}", t.shape()))),
    }
}

pub(crate) fn same_len(
    op: &'static str,
    what: &str,
    expected: usize,
    got: usize,
) -> CudaResult<()> {
    if expected != got {
        return Err(CudaError::shape(
            op,
            format!("{what} of {expected} elements"),
            format!("{got}"),
        ));
    }
    Ok(())
}

pub(crate) fn nhwc(op: &'static str, shape: &[usize]) -> CudaResult<[usize; 4]> {
    match *shape {
        [n, h, w, c] => Ok([n, h, w, c]),
        _ => Err(CudaError::shape(
            op,
            "an NHWC batch [n, h, w, c]",
            format!("{shape:?}"),
        )),
    }
}

/// Rows per chunk of the per-channel reductions: 256, raised when the grid
/// would exceed 65535 chunks. Depends only on the row count.
pub(crate) fn bn_chunking(rows: usize) -> (usize, usize) {
    let mut rpc = 256usize;
    if rows.div_ceil(rpc) > 65_535 {
        rpc = rows.div_ceil(65_535).next_multiple_of(8);
    }
    (rpc, rows.div_ceil(rpc).max(1))
}

/// Whether a kernel over rows of `channels` may go 8 channels at a time
/// (its `*_v8_f16` entry point): f16, and no 8-channel run crosses a row
/// (or an im2col tap). Its 16-byte accesses are aligned in whole tensors.
pub(crate) fn by_eight(dtype: DType, channels: usize) -> bool {
    dtype == DType::F16 && channels.is_multiple_of(8)
}

/// Launches `f` on `stream` with `cfg`, its arguments pushed by `push` in
/// the kernel's parameter order; a launch failure is reported as `op`'s.
/// The one place the op families call into the driver to run a kernel.
///
/// # Safety
///
/// The caller guarantees what the kernel's signature asks: `push` adds
/// exactly the kernel's parameters, in order and of their types (the
/// `repr(C)` params structs of `params.rs` by value, device pointers as
/// views or slices of the element types the kernel names), and every
/// buffer holds at least the elements the kernel reads or writes on
/// `cfg`'s grid. Each caller states this in its `// SAFETY:` note.
pub(crate) unsafe fn launch<'a>(
    stream: &'a CudaStream,
    f: &'a CudaFunction,
    cfg: LaunchConfig,
    op: &'static str,
    push: impl FnOnce(&mut LaunchArgs<'a>),
) -> CudaResult<()> {
    let mut b = stream.launch_builder(f);
    push(&mut b);
    // SAFETY: the arguments and buffer sizes are the caller's guarantee
    // (this function's contract).
    unsafe { b.launch(cfg) }.during(op)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_shapes() {
        let c = elementwise(1);
        assert_eq!((c.grid_dim.0, c.block_dim.0), (1, 256));
        assert_eq!(elementwise(257).grid_dim.0, 2);
        assert_eq!(elementwise(usize::MAX / 2).grid_dim.0 as usize, MAX_BLOCKS);
        assert_eq!(per_channel(129).grid_dim.0, 2);
    }

    #[test]
    fn bn_chunks_cover_the_rows_within_the_grid_limit() {
        assert_eq!(bn_chunking(2), (256, 1));
        assert_eq!(bn_chunking(128 * 28 * 28), (256, 392));
        for rows in [
            1usize,
            255,
            256,
            257,
            65_535 * 256,
            65_535 * 256 + 1,
            1 << 31,
        ] {
            let (rpc, chunks) = bn_chunking(rows);
            assert!(chunks <= 65_535 && rpc * chunks >= rows, "{rows}");
            assert!(
                rpc * (chunks - 1) < rows.max(1),
                "no empty chunk for {rows}"
            );
        }
    }
}
