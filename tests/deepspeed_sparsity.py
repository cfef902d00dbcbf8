"""The test oracle for zmpi.nn.sparsity: a transcription of DeepSpeed's
deepspeed/ops/sparse_attention/sparsity_config.py (the SparsityConfig family's constructors and
make_layout), its loops and checks as DeepSpeed writes them, on NumPy instead of torch
(torch.zeros -> numpy.zeros, torch.tril -> numpy.tril). Random blocks come from Python's global
`random` module, as in DeepSpeed: seed it with random.seed(seed) to compare with zmpi's layout
for that seed. Kept deliberately literal (docstrings dropped); do not "improve" it.
"""
# ruff: noqa: E501, B006, B905  (DeepSpeed's lines, list defaults and zips, as written)
import random

import numpy


class SparsityConfig:
    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len):
        if (seq_len % self.block != 0):
            raise ValueError(f'Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!')
        num_blocks = seq_len // self.block
        layout = numpy.zeros((self.num_heads, num_blocks, num_blocks), dtype=numpy.int64)
        return layout

    def check_and_propagate_first_head_layout(self, layout):
        if not self.different_layout_per_head:
            layout[1:self.num_heads, :, :] = layout[0, :, :]
        return layout


class DenseSparsityConfig(SparsityConfig):
    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        super().__init__(num_heads, block, different_layout_per_head)

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        layout[:, :, :] = 1
        return layout


class FixedSparsityConfig(SparsityConfig):
    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_local_blocks=4,
                 num_global_blocks=1,
                 attention='bidirectional',
                 horizontal_global_attention=False,
                 num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)

        self.num_local_blocks = num_local_blocks

        if (num_local_blocks % num_global_blocks != 0):
            raise ValueError(
                f'Number of blocks in a local window, {num_local_blocks}, must be dividable by number of global blocks, {num_global_blocks}!'
            )
        self.num_global_blocks = num_global_blocks

        if (attention != 'unidirectional' and attention != 'bidirectional'):
            raise NotImplementedError('only \"uni/bi-directional\" attentions are supported for now!')
        self.attention = attention

        if (attention != 'bidirectional' and horizontal_global_attention):
            raise ValueError('only \"bi-directional\" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention

        if (num_different_global_patterns > 1 and not different_layout_per_head):
            raise ValueError(
                'Number of different layouts cannot be more than one when you have set a single layout for all heads! Set different_layout_per_head to True.'
            )
        if (num_different_global_patterns > (num_local_blocks // num_global_blocks)):
            raise ValueError(
                f'Number of layout versions (num_different_global_patterns), {num_different_global_patterns}, cannot be larger than number of local window blocks divided by number of global blocks, {num_local_blocks} / {num_global_blocks} = {num_local_blocks//num_global_blocks}!'
            )
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h, layout):
        num_blocks = layout.shape[1]
        for i in range(0, num_blocks, self.num_local_blocks):
            end = min(i + self.num_local_blocks, num_blocks)
            for row in range(i, end):
                for col in range(i, (row + 1 if self.attention == 'unidirectional' else end)):
                    layout[h, row, col] = 1
        return layout

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        first_global_block_idx = self.num_local_blocks - (
            1 + h % self.num_different_global_patterns) * self.num_global_blocks

        # set all global blocks except the last one if (in last local window)
        end = num_blocks - (num_blocks % self.num_local_blocks)
        for i in range(first_global_block_idx, end, self.num_local_blocks):

            # vertical global attention
            first_row = 0 if self.attention == 'bidirectional' else i
            layout[h, first_row:, i:i + self.num_global_blocks] = 1

            # horizontal global attention; only in bidirectional attention
            if (self.horizontal_global_attention):
                layout[h, i:i + self.num_global_blocks, :] = 1

        # set last global blocks; handle possible short last local window
        if (end < num_blocks):
            start = min(end + first_global_block_idx, num_blocks - self.num_global_blocks)
            end = start + self.num_global_blocks

            # vertical global attention
            first_row = 0 if self.attention == 'bidirectional' else start
            layout[h, first_row:, start:end] = 1

            # horizontal global attention
            if (self.horizontal_global_attention):
                layout[h, start:end, :] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(0, self.num_layout_heads):
            layout = self.set_local_layout(h, layout)
            layout = self.set_global_layout(h, layout)

        layout = self.check_and_propagate_first_head_layout(layout)
        return layout


class VariableSparsityConfig(SparsityConfig):
    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_random_blocks=0,
                 local_window_blocks=[4],
                 global_block_indices=[0],
                 global_block_end_indices=None,
                 attention='bidirectional',
                 horizontal_global_attention=False):
        super().__init__(num_heads, block, different_layout_per_head)

        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = local_window_blocks
        self.global_block_indices = global_block_indices

        if (global_block_end_indices is not None):
            if (len(global_block_indices) != len(global_block_end_indices)):
                raise ValueError(
                    f'Global block start indices length, {len(global_block_indices)}, must be same as global block end indices length, {len(global_block_end_indices)}!'
                )
            for _, (start_idx, end_idx) in enumerate(zip(global_block_indices, global_block_end_indices)):
                if start_idx >= end_idx:
                    raise ValueError(
                        f'Global block start index, {start_idx}, must be smaller than global block end index, {end_idx}!'
                    )
        self.global_block_end_indices = global_block_end_indices

        if (attention != 'unidirectional' and attention != 'bidirectional'):
            raise NotImplementedError('only \"uni/bi-directional\" attentions are supported for now!')
        self.attention = attention

        if (attention != 'bidirectional' and horizontal_global_attention):
            raise ValueError('only \"bi-directional\" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if (num_blocks < self.num_random_blocks):
            raise ValueError(
                f'Number of random blocks, {self.num_random_blocks}, must be smaller than overall number of blocks in a row, {num_blocks}!'
            )
        for row in range(0, num_blocks):
            rnd_cols = random.sample(range(0, num_blocks), self.num_random_blocks)
            layout[h, row, rnd_cols] = 1
        return layout

    def set_local_layout(self, h, layout):
        num_blocks = layout.shape[1]
        start_block_idx = 0
        end_block_idx = 0
        for block_size in self.local_window_blocks:
            end_block_idx += block_size
            end_block_idx = min(end_block_idx, num_blocks)
            for row in range(start_block_idx, end_block_idx):
                for col in range(start_block_idx, (row + 1 if self.attention == 'unidirectional' else end_block_idx)):
                    layout[h, row, col] = 1
            start_block_idx += block_size

        # if there is any remaining not attended part, use the lats local window block size as local window for the remaining applicable local windows
        for i in range(start_block_idx, num_blocks, block_size):
            end_block_idx = min(i + block_size, num_blocks)
            for row in range(i, end_block_idx):
                for col in range(i, (row + 1 if self.attention == 'unidirectional' else end_block_idx)):
                    layout[h, row, col] = 1
        return layout

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if (self.global_block_end_indices is None):
            for idx in self.global_block_indices:
                # if global block idx is in the range of the sequence blocks
                if (idx < num_blocks):
                    #global rows
                    if (self.horizontal_global_attention):
                        layout[h, idx, :] = 1

                    #global columns
                    first_row = 0 if self.attention == 'bidirectional' else idx
                    layout[h, first_row:, idx] = 1
        else:
            for _, (start_idx, end_idx) in enumerate(zip(self.global_block_indices, self.global_block_end_indices)):
                # if global block idx is in the range of the sequence blocks
                if (start_idx < num_blocks):
                    end_idx = min(end_idx, num_blocks)
                    #global rows
                    if (self.horizontal_global_attention):
                        layout[h, start_idx:end_idx, :] = 1

                    #global columns
                    first_row = 0 if self.attention == 'bidirectional' else start_idx
                    layout[h, first_row:, start_idx:end_idx] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(0, self.num_layout_heads):
            layout = self.set_random_layout(h, layout)
            layout = self.set_local_layout(h, layout)
            layout = self.set_global_layout(h, layout)

        layout = self.check_and_propagate_first_head_layout(layout)
        return layout


class BigBirdSparsityConfig(SparsityConfig):
    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_random_blocks=1,
                 num_sliding_window_blocks=3,
                 num_global_blocks=1,
                 attention='bidirectional'):
        super().__init__(num_heads, block, different_layout_per_head)

        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks

        if (attention != 'unidirectional' and attention != 'bidirectional'):
            raise NotImplementedError('only \"uni/bi-directional\" attentions are supported for now!')
        self.attention = attention

    def set_random_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if (num_blocks < self.num_random_blocks):
            raise ValueError(
                f'Number of random blocks, {self.num_random_blocks}, must be smaller than overall number of blocks in a row, {num_blocks}!'
            )

        for row in range(0, num_blocks):
            sample_range = range(0, num_blocks) if self.attention == 'bidirectional' else range(0, row + 1)
            rnd_cols = random.sample(sample_range, self.num_random_blocks)
            layout[h, row, rnd_cols] = 1
        return layout

    def set_sliding_window_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if (num_blocks < self.num_sliding_window_blocks):
            raise ValueError(
                f'Number of sliding window blocks, {self.num_sliding_window_blocks}, must be smaller than overall number of blocks in a row, {num_blocks}!'
            )

        w = self.num_sliding_window_blocks // 2
        for row in range(0, num_blocks):
            start = max(0, row - w)
            end = min(row + w + 1, num_blocks)
            layout[h, row, start:end] = 1
        return layout

    def set_global_layout_itc(self, h, layout):
        num_blocks = layout.shape[1]
        if (num_blocks < self.num_global_blocks):
            raise ValueError(
                f'Number of global blocks, {self.num_global_blocks}, must be smaller than overall number of blocks in a row, {num_blocks}!'
            )

        #global rows
        layout[h, 0:self.num_global_blocks, :] = 1

        #global columns
        layout[h, :, 0:self.num_global_blocks] = 1

        if self.attention == 'unidirectional':
            # zero out anything attending to the future
            layout = numpy.tril(layout)

        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(0, self.num_layout_heads):
            layout = self.set_random_layout(h, layout)
            layout = self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout_itc(h, layout)

        layout = self.check_and_propagate_first_head_layout(layout)
        return layout


class BSLongformerSparsityConfig(SparsityConfig):
    def __init__(self,
                 num_heads,
                 block=16,
                 different_layout_per_head=False,
                 num_sliding_window_blocks=3,
                 global_block_indices=[0],
                 global_block_end_indices=None,
                 attention='bidirectional'):
        super().__init__(num_heads, block, different_layout_per_head)

        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = global_block_indices
        self.attention = attention

        if (global_block_end_indices is not None):
            if (len(global_block_indices) != len(global_block_end_indices)):
                raise ValueError(
                    f'Global block start indices length, {len(global_block_indices)}, must be same as global block end indices length, {len(global_block_end_indices)}!'
                )
            for _, (start_idx, end_idx) in enumerate(zip(global_block_indices, global_block_end_indices)):
                if start_idx >= end_idx:
                    raise ValueError(
                        f'Global block start index, {start_idx}, must be smaller than global block end index, {end_idx}!'
                    )
        self.global_block_end_indices = global_block_end_indices

    def set_sliding_window_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if (num_blocks < self.num_sliding_window_blocks):
            raise ValueError(
                f'Number of sliding window blocks, {self.num_sliding_window_blocks}, must be smaller than overall number of blocks in a row, {num_blocks}!'
            )

        w = self.num_sliding_window_blocks // 2
        for row in range(0, num_blocks):
            start = max(0, row - w)
            end = min(row + w + 1, num_blocks)
            layout[h, row, start:end] = 1
        return layout

    def set_global_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if (self.global_block_end_indices is None):
            for idx in self.global_block_indices:
                # if global block idx is in the range of the sequence blocks
                if (idx < num_blocks):
                    #global rows
                    layout[h, idx, :] = 1

                    #global columns
                    layout[h, :, idx] = 1
        else:
            for _, (start_idx, end_idx) in enumerate(zip(self.global_block_indices, self.global_block_end_indices)):
                # if global block idx is in the range of the sequence blocks
                if (start_idx < num_blocks):
                    end_idx = min(end_idx, num_blocks)
                    #global rows
                    layout[h, start_idx:end_idx, :] = 1

                    #global columns
                    layout[h, :, start_idx:end_idx] = 1
        if self.attention == 'unidirectional':
            layout = numpy.tril(layout)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(0, self.num_layout_heads):
            layout = self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout(h, layout)

        layout = self.check_and_propagate_first_head_layout(layout)
        return layout


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    def __init__(self, num_heads, block=16, num_sliding_window_blocks=3, attention='unidirectional'):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h, layout):
        num_blocks = layout.shape[1]
        if (num_blocks < self.num_sliding_window_blocks):
            raise ValueError(
                f'Number of sliding window blocks, {self.num_sliding_window_blocks}, must be smaller than overall number of blocks in a row, {num_blocks}!'
            )

        w = self.num_sliding_window_blocks // 2
        for row in range(0, num_blocks):
            start = max(0, row - w)
            end = min(row + w + 1, num_blocks) if self.attention == "bidirectional" else row + 1
            layout[h, row, start:end] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(0, self.num_layout_heads):
            layout = self.set_sliding_window_layout(h, layout)
        layout = self.check_and_propagate_first_head_layout(layout)
        return layout


MODES = {"dense": DenseSparsityConfig, "fixed": FixedSparsityConfig,
         "variable": VariableSparsityConfig, "bigbird": BigBirdSparsityConfig,
         "bslongformer": BSLongformerSparsityConfig, "local": LocalSlidingWindowSparsityConfig}
