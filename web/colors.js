// One colour per device, the same in the topology, the shard layout and the legend. A node
// keeps its colour while the page is open, so a re-plan does not repaint the survivors.

const PALETTE = ["#4c8dff", "#f59f3a", "#2fc59a", "#d46bf0", "#f2d244", "#ff6b76",
  "#5ad1e6", "#a3d65c", "#ff9ecf", "#b39bff"];
const assigned = new Map();

export function deviceColor(nodeId) {
  if (!assigned.has(nodeId)) assigned.set(nodeId, PALETTE[assigned.size % PALETTE.length]);
  return assigned.get(nodeId);
}

// Claim colours in a stable order (sorted ids) the first time a set of nodes is seen.
export function claimColors(nodeIds) {
  [...nodeIds].sort().forEach(deviceColor);
}
