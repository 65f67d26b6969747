/* The eval callback of actors.backends.llamacpp.ggml_capture.LayerCapture, in C.
 *
 * llama.cpp's scheduler calls the eval callback with ask=true for every node of the graph (about 40 per layer) to
 * learn which ones the caller wants to read. A Python (ctypes) callback costs ~8 us per call plus a GIL acquisition,
 * ~3 ms per decode step of a 9-layer shard: more than the shard's own compute. Here the name check runs in C; only
 * the claimed nodes (ask=false) call back into Python: the layer output to copy out, and, for models whose layers
 * exchange several residual streams (deepseek4's hyper-connections), the input node whose rows are overwritten
 * with the previous shard's streams before any layer reads them.
 *
 * Built at first use by ggml_capture._native() with the system C compiler; no ggml headers are needed, the tensor
 * name's offset is passed in (ggml_capture checks the struct layout against the loaded libggml at runtime).
 */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef bool (*swarmroute_copy_fn)(void *tensor);

struct swarmroute_capture {
    int64_t name_offset;     /* offsetof(struct ggml_tensor, name) */
    swarmroute_copy_fn copy; /* the Python side: returns whether the scheduler should go on */
    char key[64];            /* the node copied out, e.g. "l_out-<il>", NUL-terminated; "" for none */
    char inject_key[64];     /* the node overwritten with input rows, e.g. "hc_init"; "" for none */
};

bool swarmroute_capture_eval(void *tensor, bool ask, void *user_data) {
    const struct swarmroute_capture *c = (const struct swarmroute_capture *)user_data;
    if (ask) {
        const char *name = (const char *)tensor + c->name_offset;
        return (c->key[0] && strncmp(name, c->key, sizeof c->key) == 0)
            || (c->inject_key[0] && strncmp(name, c->inject_key, sizeof c->inject_key) == 0);
    }
    return c->copy(tensor);
}
