//! Element-wise passes over flat vectors of any length (a model's gradients, its 16-bit
//! copies), spread over the threads of the current rayon pool in chunks of a fixed size. A sum
//! adds the chunks' partial sums in order, so that it is the same whatever the number of threads.

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

/// Elements per parallel task.
pub const CHUNK: usize = 1 << 16;

/// `src` (bf16 or f16) widened to f32, exactly.
pub fn widen<H: Sync>(src: &[H]) -> Vec<f32>
where
    [H]: HalfFloatSliceExt,
{
    let mut out = vec![0.0f32; src.len()];
    out.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(o, s)| s.convert_to_f32_slice(o));
    out
}

/// `src` rounded to the 16-bit type `H` (to nearest, ties to even).
pub fn narrow<H: Copy + Default + Send + Sync>(src: &[f32]) -> Vec<H>
where
    [H]: HalfFloatSliceExt,
{
    let mut out = vec![H::default(); src.len()];
    out.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(o, s)| o.convert_from_f32_slice(s));
    out
}

/// The sum of the squares of `values`, in f64, and with `count_non_finite` how many of them are
/// not finite (a NaN or an infinity among them makes the sum one too).
pub fn stats(values: &[f32], count_non_finite: bool) -> (f64, usize) {
    let parts: Vec<(f64, usize)> = values
        .par_chunks(CHUNK)
        .map(|c| {
            let bad = if count_non_finite {
                c.iter().filter(|x| !x.is_finite()).count()
            } else {
                0
            };
            (chunk_sum_squares(c), bad)
        })
        .collect();
    parts.iter().fold((0.0, 0), |(sum, bad), &(s, b)| (sum + s, bad + b))
}

/// The sum of the squares of `values`, in f64.
pub fn sum_squares(values: &[f32]) -> f64 {
    stats(values, false).0
}

/// Multiplies every element of `values` by `coef`.
pub fn scale(values: &mut [f32], coef: f32) {
    values
        .par_chunks_mut(CHUNK)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= coef));
}

/// One chunk's sum of squares, over eight independent partial sums (which the compiler keeps in
/// vector registers; one running sum would wait on each addition).
fn chunk_sum_squares(c: &[f32]) -> f64 {
    const LANES: usize = 8;
    let mut lanes = [0.0f64; LANES];
    let mut blocks = c.chunks_exact(LANES);
    for block in &mut blocks {
        for (lane, &v) in lanes.iter_mut().zip(block) {
            *lane += f64::from(v) * f64::from(v);
        }
    }
    let rest: f64 = blocks.remainder().iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    lanes.iter().sum::<f64>() + rest
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Reference: a plain f64 loop, one element at a time; and the chunks' own sums added in
    /// order on one thread, which every pool must give bit for bit (a tree of partial sums, as
    /// rayon's `reduce` builds, would depend on how the work was split).
    #[test]
    fn sums_of_squares_match_a_float64_loop_and_do_not_depend_on_the_threads() {
        // 64 chunks and a ragged end, of magnitudes from 1e-6 to 1e6, so that the order of the
        // additions shows in the last bits.
        let g: Vec<f32> = (0..64 * CHUNK + 1001)
            .map(|i| ((i % 97) as f32 - 48.0) * 10f32.powi((i / CHUNK % 13) as i32 - 6))
            .collect();
        let reference: f64 = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let (sum, bad) = stats(&g, true);
        // The reference's own rounding, one running sum of 4.2M terms, reaches about 1e-10.
        assert!((sum - reference).abs() <= 1e-9 * reference, "{sum} vs {reference}");
        assert_eq!(bad, 0);
        let in_order = g.chunks(CHUNK).map(chunk_sum_squares).fold(0.0, |a, b| a + b);
        for threads in [1, 2, 3, 7] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            assert_eq!(
                pool.install(|| sum_squares(&g)).to_bits(),
                in_order.to_bits(),
                "{threads} threads"
            );
        }
        let mut g = g;
        g[5] = f32::NAN;
        g[2 * CHUNK + 3] = f32::NEG_INFINITY;
        let (sum, bad) = stats(&g, true);
        assert_eq!(bad, 2);
        assert!(!sum.is_finite());
        assert_eq!(stats(&g, false).1, 0, "not counted unless asked");
        assert_eq!(stats(&[], true), (0.0, 0));
    }

    /// Reference: `half`'s scalar conversions and plain multiplication, element by element,
    /// over more than one chunk and the values where rounding is delicate.
    #[test]
    fn conversions_and_scaling_match_the_scalar_ones() {
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            70000.0,              // beyond f16's largest (65504): infinity
            1e-40,                // an f32 subnormal
            3e-8,                 // an f16 subnormal
            1.0 + 1.0 / 256.0,    // halfway between two bf16 values: to even
            -(1.0 + 3.0 / 256.0), // halfway, rounded away from zero to even
            0.0,
            -0.0,
        ];
        let v: Vec<f32> = special
            .into_iter()
            .chain((0..CHUNK + 77).map(|i| (i as f32 * 0.37).sin() * 1e3 + 1e-7 * i as f32))
            .collect();
        let b: Vec<bf16> = narrow(&v);
        let h: Vec<f16> = narrow(&v);
        assert!(b
            .iter()
            .zip(&v)
            .all(|(b, &x)| b.to_bits() == bf16::from_f32(x).to_bits()));
        assert!(h
            .iter()
            .zip(&v)
            .all(|(h, &x)| h.to_bits() == f16::from_f32(x).to_bits()));
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
        assert_eq!(bits(widen(&b)), bits(b.iter().map(|x| x.to_f32()).collect()));
        assert_eq!(bits(widen(&h)), bits(h.iter().map(|x| x.to_f32()).collect()));
        let mut s = v.clone();
        scale(&mut s, 0.5);
        assert_eq!(bits(s), bits(v.iter().map(|x| x * 0.5).collect()));
    }
}
