// Numbers for people: bytes, rates, durations, ranges. Missing values read "not measured".

export const NOT_MEASURED = "not measured";

const known = (value) => typeof value === "number" && Number.isFinite(value) && value > 0;

function scaled(value, units, base) {
  let index = 0;
  while (Math.abs(value) >= base && index < units.length - 1) {
    value /= base;
    index += 1;
  }
  const digits = value >= 100 || index === 0 ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(digits)} ${units[index]}`;
}

export const bytes = (value) => (known(value) ? scaled(value, ["B", "KB", "MB", "GB", "TB"], 1000)
  : NOT_MEASURED);
export const rate = (value) => (known(value) ? `${scaled(value, ["B", "KB", "MB", "GB", "TB"], 1000)}/s`
  : NOT_MEASURED);
export const flops = (value) => (known(value)
  ? `${scaled(value, ["FLOP", "KFLOP", "MFLOP", "GFLOP", "TFLOP"], 1000)}/s` : NOT_MEASURED);

export function seconds(value) {
  if (!known(value)) return NOT_MEASURED;
  if (value < 1e-3) return `${(value * 1e6).toFixed(0)} µs`;
  if (value < 1) return `${(value * 1e3).toFixed(value < 0.01 ? 2 : 1)} ms`;
  return `${value.toFixed(2)} s`;
}

export const count = (value) => Number(value).toLocaleString("en-US");
export const percent = (fraction) => `${(fraction * 100).toFixed(fraction < 0.1 ? 1 : 0)}%`;
// Half-open [start, stop) as people read it: the first and last index held.
export const span = ({ start, stop }) => (stop > start ? (stop - start === 1 ? `${start}`
  : `${count(start)}–${count(stop - 1)}`) : "none");
export const spanSize = ({ start, stop }) => stop - start;
export const plural = (n, word, many = `${word}s`) => `${count(n)} ${n === 1 ? word : many}`;
// A wait or an age as people say it: "12 s", "4 min", "2 h 5 min" (whole units, rounded).
export function duration(value) {
  if (typeof value !== "number" || !Number.isFinite(value) || value < 0) return NOT_MEASURED;
  if (Math.round(value) < 60) return `${Math.round(value)} s`;
  const minutes = Math.round(value / 60);
  if (minutes < 60) return `${minutes} min`;
  const rest = minutes % 60;
  return `${Math.floor(minutes / 60)} h${rest ? ` ${rest} min` : ""}`;
}
