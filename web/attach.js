// Images for the next chat message: picked with the attach button or pasted into the message
// box, shown as removable thumbnails until sent. Offered only while the chat's model takes
// images (its /v1/models entry lists "vision" in its capabilities): a text-only model answers
// an image with a 400, so the page does not let one be attached.

import { h } from "./dom.js";

// The API reads at most 4 MiB of request body (exo_tp/api/http_io.py), images included as
// base64 (4/3 of their bytes), in every later turn too: a larger file (a phone's photo) is
// re-encoded smaller here, past what the vision models' processors keep anyway.
const REENCODE_BYTES = 1024 * 1024;
const REENCODE_SIDE = 1600;
const REENCODE_QUALITY = 0.88;

// The chat model's entry decides; a name no entry has is served by the loaded model (the
// API serves any name when it has one model, else answers 404, shown as any error).
export function takesImages(models, name) {
  const entry = models.find((m) => m.id === name) ?? models.find((m) => m.loaded);
  return Boolean(entry?.capabilities?.includes("vision"));
}

// A user turn: a plain string without images (as before), else OpenAI content parts, the
// images first and the text after them.
export function userContent(text, images) {
  if (images.length === 0) return text;
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  if (text) parts.push({ type: "text", text });
  return parts;
}

export function thumbnails(urls, onRemove = null) {
  return urls.map((url, index) => h("figure", { class: "thumb" },
    h("img", { src: url, alt: `attached image ${index + 1}` }),
    onRemove ? h("button", { type: "button", class: "thumb-remove", title: "remove this image",
      "aria-label": `remove image ${index + 1}`, onclick: () => onRemove(index) }, "×") : null));
}

function readDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

async function shrunk(file) {
  const bitmap = await createImageBitmap(file);
  const scale = Math.min(1, REENCODE_SIDE / Math.max(bitmap.width, bitmap.height));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(bitmap.width * scale));
  canvas.height = Math.max(1, Math.round(bitmap.height * scale));
  canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  return canvas.toDataURL("image/jpeg", REENCODE_QUALITY);
}

// A file as the data URL sent: as it is, or re-encoded when large, the browser can decode it
// and that makes it smaller (else as it is, and the server says what is wrong with it).
async function dataUrl(file) {
  const original = await readDataUrl(file);
  if (file.size <= REENCODE_BYTES) return original;
  try {
    const smaller = await shrunk(file);
    return smaller.length < original.length ? smaller : original;
  } catch {
    return original; // not decodable here
  }
}

export class Attachments {
  constructor({ button, file, strip, note, input }) {
    Object.assign(this, { button, file, strip, note });
    this.urls = [];
    this.vision = false; // until /v1/models says otherwise
    this.reading = Promise.resolve();
    button.addEventListener("click", () => file.click());
    file.addEventListener("change", () => {
      const files = [...file.files];
      file.value = ""; // the same file can be picked again
      this.add(files);
    });
    input.addEventListener("paste", (event) => this.paste(event));
  }

  setVision(vision) {
    this.vision = vision;
    this.button.hidden = !vision;
    this.file.disabled = !vision;
    if (!vision && this.urls.length) this.set([]); // a text-only model would refuse them
  }

  paste(event) {
    const data = event.clipboardData;
    const items = [...(data?.items || [])].filter((item) => item.kind === "file");
    const files = (items.length ? items.map((item) => item.getAsFile()) : [...(data?.files || [])])
      .filter((f) => f && f.type.startsWith("image/"));
    if (files.length === 0) return; // text pastes as usual
    if (!this.vision) {
      this.tell("The model does not take images: the pasted image was left out.");
      return;
    }
    this.add(files);
  }

  add(files) {
    const images = files.filter((f) => f.type.startsWith("image/"));
    if (images.length < files.length) this.tell("Only images can be attached.");
    // in order, after any still being read: a send waits for them (ready())
    this.reading = this.reading.then(async () => {
      for (const image of images) {
        try {
          this.set([...this.urls, await dataUrl(image)]);
        } catch (error) {
          this.tell(`${image.name || "the image"} could not be read: ${error.message}`);
        }
      }
    });
    return this.reading;
  }

  ready() {
    return this.reading;
  }

  // Sent: the strip empties; restore() puts them back when nothing was answered.
  take() {
    this.set([]);
    this.tell(null);
  }

  restore(urls) {
    if (this.urls.length === 0 && this.vision) this.set(urls);
  }

  set(urls) {
    this.urls = urls;
    this.strip.hidden = urls.length === 0;
    this.strip.replaceChildren(...thumbnails(urls,
      (index) => this.set(this.urls.filter((_, i) => i !== index))));
  }

  tell(text) {
    this.note.hidden = !text;
    this.note.textContent = text || "";
  }
}
