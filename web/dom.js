// Building DOM and SVG without innerHTML (node ids and API messages are untrusted text),
// and the one hover tooltip every drawing shares.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(element, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") element.setAttribute("class", value);
    else if (key === "style" && typeof value === "object") {
      // setProperty: custom properties (--device) cannot be assigned as fields
      for (const [name, v] of Object.entries(value)) element.style.setProperty(name, v);
    }
    else if (key === "dataset") Object.assign(element.dataset, value);
    else if (key.startsWith("on")) element.addEventListener(key.slice(2), value);
    else element.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return element;
}

export const h = (tag, attrs, ...children) => build(document.createElement(tag), attrs, children);
export const s = (tag, attrs, ...children) =>
  build(document.createElementNS(SVG_NS, tag), attrs, children);

// Elements with a data-tip show it (multi-line text) in the shared tooltip on hover or focus.
export function installTooltip(tooltip) {
  const show = (target, x, y) => {
    tooltip.textContent = target.dataset.tip;
    tooltip.hidden = false;
    const pad = 14;
    const { width, height } = tooltip.getBoundingClientRect();
    const left = Math.min(x + pad, window.innerWidth - width - 4);
    const top = y + pad + height > window.innerHeight ? y - height - pad : y + pad;
    tooltip.style.left = `${Math.max(4, left)}px`;
    tooltip.style.top = `${Math.max(4, top)}px`;
  };
  const tipTarget = (event) => event.target.closest?.("[data-tip]");
  document.addEventListener("mousemove", (event) => {
    const target = tipTarget(event);
    if (target) show(target, event.clientX, event.clientY);
    else tooltip.hidden = true;
  });
  document.addEventListener("focusin", (event) => {
    const target = tipTarget(event);
    if (!target) return;
    const box = target.getBoundingClientRect();
    show(target, box.left, box.bottom);
  });
  document.addEventListener("focusout", () => { tooltip.hidden = true; });
  document.addEventListener("scroll", () => { tooltip.hidden = true; }, true);
}
